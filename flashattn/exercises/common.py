"""What every checker shares: the error it raises, calling the learner's function (a stub becomes
"not implemented yet"), comparing an output with the reference, and launching a learner's kernel.

A checker either prints a line starting with "PASSED" or raises :class:`ExerciseError` whose
message says which output is wrong, where, and by how much (with an error heatmap where a picture
helps). It never passes silently: every checker compares against a reference on inputs it draws
itself, and an unimplemented exercise (the student stub raises NotImplementedError) fails with
"not implemented yet".
"""
import ast
import inspect
import re

import numpy as np
import torch


class ExerciseError(AssertionError):
    """Raised by a checker: the message is meant for the learner."""


def not_implemented(name):
    """The error for an exercise whose stub has not been replaced yet."""
    return ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` "
                         "with your code, then run this check again.")


def attempt(fn, *args, name=None, **kwargs):
    """Call the learner's ``fn``; turn the stub's NotImplementedError into a clear failure."""
    name = name or getattr(fn, "__name__", "your function")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise not_implemented(name) from None


def passed(what):
    print(f"PASSED: {what}")


def close(got, want, atol, rtol):
    """Quietly: is ``got`` close to ``want`` (same shape, NaN where want is NaN, equal infinities)?
    Used to recognise a known mistake, so that the message can name it."""
    try:
        g = torch.as_tensor(got).detach().double().cpu()
    except Exception:
        return False
    w = want.detach().double().cpu()
    if g.shape != w.shape:
        return False
    return bool(torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True).all())


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
        import matplotlib.pyplot as plt

        from ..plotting import error_heatmap

        error_heatmap(g.reshape(-1, *g.shape[-2:])[0], w.reshape(-1, *w.shape[-2:])[0],
                      title=f"where {name} is wrong (first matrix)")
        plt.show()
    raise ExerciseError(message)


# --- The learner's @triton.jit functions ------------------------------------------------------------

def is_stub(fn):
    """Whether the source of the learner's function (a @triton.jit one included) still holds the
    stub's ``raise NotImplementedError``."""
    try:
        source = inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return False
    return re.search(r"^\s*raise NotImplementedError", source, re.M) is not None


def _error_chain(error):
    chain, cause = [], error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _stub_raised(error):
    """Whether a launch failed because a stub's ``raise NotImplementedError()`` was reached.

    The interpreter runs the stub, so the NotImplementedError itself is in the chain of errors. A
    GPU compiles it instead, and the compiler refuses any ``raise``: its error is an
    UnsupportedLanguageConstruct whose AST node is the raise statement, and when the learner's
    function is called by the exercise's kernel it is the *cause* of the error the launch reports
    (whose own text only shows the calling line)."""
    for cause in _error_chain(error):
        if isinstance(cause, NotImplementedError) and not str(cause):
            return True
        node = getattr(cause, "node", None)  # Triton's CompilationError keeps the AST node
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in ast.unparse(node.exc):
            return True
    return False


def launch_error(error, name, constexprs):
    """The ExerciseError for a failed launch (or compilation) of a kernel around the learner's
    function ``name``."""
    if _stub_raised(error):
        return not_implemented(name)
    text = " <- ".join(f"{type(c).__name__}: {c}" for c in _error_chain(error))
    shown = {k: v for k, v in constexprs.items() if not callable(v)}  # not the learner's function
    return ExerciseError(f"{name} failed when its kernel ran with {shown}: {text[:2000]}")


def launch_learner_kernel(kernel, grid, args, constexprs, name, learner):
    """Launch ``kernel`` (the learner's @triton.jit ``learner`` itself, or a kernel that calls it),
    the same way on both runtimes: a stub (its source still raises NotImplementedError; or, should
    that check miss, the error of the launch says so) becomes 'not implemented yet', any other
    failure a readable ExerciseError that keeps the original error as its cause."""
    if is_stub(learner):
        raise not_implemented(name)
    try:
        kernel[grid](*args, **constexprs)
    except Exception as error:  # the interpreter and the compiler wrap errors raised inside
        raise launch_error(error, name, constexprs) from error
