"""Checkers for the exercises: each takes a learner's function and says clearly what is right or wrong.

A checker either prints a line starting with "PASSED" or raises :class:`ExerciseError` whose
message says which output is wrong, where, and by how much (with an error heatmap where a picture
helps). It never passes silently: every checker compares against a reference on inputs it draws
itself, and an unimplemented exercise (the student stub raises NotImplementedError) fails with
"not implemented yet".
"""
import numpy as np
import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message is meant for the learner."""


def attempt(fn, *args, name=None, **kwargs):
    """Call the learner's ``fn``; turn the stub's NotImplementedError into a clear failure."""
    name = name or getattr(fn, "__name__", "your function")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` "
                            "with your code, then run this check again.") from None


def expect_close(name, got, want, atol=1e-6, rtol=1e-6, heatmap=False):
    """Compare one output of the learner with the reference; raise with a precise message if not
    close. ``got`` may be any array-like; ``want`` is a tensor. With ``heatmap``, a failing 2-D
    (or batched 2-D) output also shows where the error is."""
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got)
        except Exception:
            raise ExerciseError(f"{name} should be a tensor, got {type(got).__name__}") from None
    if tuple(got.shape) != tuple(want.shape):
        raise ExerciseError(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    bad_nan = torch.isnan(g) & ~torch.isnan(w)
    if bad_nan.any():
        idx = tuple(int(i) for i in bad_nan.nonzero()[0])
        raise ExerciseError(f"{name} has {int(bad_nan.sum())} NaN value(s), the first at index {idx} "
                            f"(expected {w[idx].item():.6g}). A NaN often comes from inf - inf or 0/0.")
    err = (g - w).abs()
    err = torch.where(torch.isnan(w) & torch.isnan(g), torch.zeros_like(err), err)
    err = torch.where(torch.isinf(w) & (g == w), torch.zeros_like(err), err)
    allowed = atol + rtol * w.abs().nan_to_num(posinf=0, neginf=0)
    if (err <= allowed).all():
        return
    worst = tuple(int(i) for i in np.unravel_index(int((err - allowed).flatten().argmax()), err.shape))
    count = int((err > allowed).sum())
    message = (f"{name} is wrong at {count} of {err.numel()} positions. Worst at index {worst}: "
               f"got {g[worst].item():.6g}, expected {w[worst].item():.6g} "
               f"(error {err[worst].item():.2e}, allowed {allowed[worst].item():.2e}).")
    if heatmap and g.dim() >= 2:
        from .plotting import error_heatmap
        import matplotlib.pyplot as plt

        error_heatmap(g.reshape(-1, *g.shape[-2:])[0], w.reshape(-1, *w.shape[-2:])[0],
                      title=f"where {name} is wrong (first matrix)")
        plt.show()
    raise ExerciseError(message)


def passed(what):
    print(f"PASSED: {what}")


# Checkers for each chapter follow, in chapter order. Each is named check_<exercise> and draws its
# own inputs (several shapes, including awkward ones) so that a hard-coded answer cannot pass.
