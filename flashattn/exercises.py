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


# --- Chapters 00-02: attention and memory, online softmax, exp2 and LSE ---------------------------

def _close(got, want, atol, rtol):
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


def _result(fn, *args, name, count=None):
    """Call the learner's function; check the kind of result before any comparison."""
    out = attempt(fn, *args, name=name)
    if count is not None:
        if not isinstance(out, (tuple, list)) or len(out) != count:
            raise ExerciseError(f"{name} should return a tuple of {count} tensors, got "
                                f"{type(out).__name__}{'' if not isinstance(out, (tuple, list)) else ' of ' + str(len(out))}")
        return tuple(torch.as_tensor(o) for o in out)
    if isinstance(out, (tuple, list)):
        raise ExerciseError(f"{name} should return one tensor, got a {type(out).__name__} of "
                            f"{len(out)} items (return only the output, not extra values)")
    return out


def _diagnose(name, got, want, mistakes, atol, rtol, where=""):
    """Compare ``got`` with ``want``; if it is wrong, name the mistake it matches, if any.

    ``mistakes`` is a list of ``(hint, tensor)``: what a known wrong solution returns on the same
    input, and what to tell the learner when theirs returns the same."""
    if _close(got, want, atol, rtol):
        return
    for hint, wrong in mistakes:
        if wrong is not None and not _close(wrong, want, atol, rtol) and _close(got, wrong, atol, rtol):
            raise ExerciseError(f"{name} is wrong{where}: {hint}")
    try:
        expect_close(name, got, want, atol=atol, rtol=rtol)
    except ExerciseError as err:
        raise ExerciseError(f"{err}{where}") from None


def _causal_attention64(q, k, v, scale, visible=None, fill=float("-inf"), dim=-1):
    """Masked attention in float64 with a given visibility rule (the reference and its mistakes)."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-2, -1) * scale
    if visible is not None:
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        s = s.masked_fill(~visible(i, j, q.shape[-2], k.shape[-2]), fill)
    return torch.softmax(s, dim=dim) @ v


def check_naive_causal_attention(fn):
    """Chapter 00: ``fn(q, k, v, scale)`` must return softmax(q k^T * scale, causal) v, with the
    causal mask aligned top-left (query i sees keys 0..i), for any leading dims and N_q != N_kv."""
    name = getattr(fn, "__name__", "naive_causal_attention")
    g = torch.Generator().manual_seed(0)
    top_left = lambda i, j, nq, nk: j <= i                      # noqa: E731
    cases = [((1, 1), 1, 1, 1, None), ((2, 3), 17, 17, 8, None), ((1, 2), 5, 11, 16, 0.37),
             ((2, 1), 13, 6, 5, 1.3), ((3,), 9, 12, 4, None), ((1, 1), 23, 40, 7, 0.2)]
    for lead, n_q, n_kv, d, scale in cases:
        scale = d ** -0.5 if scale is None else scale
        q = torch.randn(*lead, n_q, d, generator=g, dtype=torch.float64) * 1.5
        k = torch.randn(*lead, n_kv, d, generator=g, dtype=torch.float64) * 1.5
        v = torch.randn(*lead, n_kv, d, generator=g, dtype=torch.float64)
        got = _result(fn, q.clone(), k.clone(), v.clone(), scale, name=name)
        want = _causal_attention64(q, k, v, scale, top_left)
        where = f" (q, k, v of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, scale {scale:.3g})"
        got_t = torch.as_tensor(got)
        if got_t.shape == want.shape and torch.isnan(got_t.double()).any():
            row = int(torch.isnan(got_t.double()).nonzero()[0][-2])
            raise ExerciseError(
                f"{name} returned NaN in query row {row}{where}. A row whose scores are all -inf "
                "gives NaN: is every query allowed to see key 0 and itself? (the mask is j <= i, "
                "the diagonal included)")
        mistakes = [
            ("it matches attention WITHOUT the causal mask: hide the scores where key j > query i "
             "(set them to -inf before the softmax)", _causal_attention64(q, k, v, scale)),
            ("it matches a causal mask aligned bottom-right (query i sees keys up to i + N_kv - N_q). "
             "This course aligns it top-left like scaled_dot_product_attention: query i sees keys 0..i",
             _causal_attention64(q, k, v, scale, lambda i, j, nq, nk: j <= i + nk - nq)
             if n_q <= n_kv else None),
            ("it matches a mask that is flipped (query i sees keys i..N_kv-1): keep j <= i, not j >= i",
             _causal_attention64(q, k, v, scale, lambda i, j, nq, nk: j >= i) if n_q <= n_kv else None),
            ("hidden scores must become -inf before the softmax, not 0 (e^0 = 1 still gives them weight)",
             _causal_attention64(q, k, v, scale, top_left, fill=0.0)),
            ("it matches scale = 1: multiply q k^T by the `scale` argument",
             _causal_attention64(q, k, v, 1.0, top_left)),
            ("it matches scale = 1/sqrt(D): use the `scale` argument you are given, not a fixed one",
             _causal_attention64(q, k, v, d ** -0.5, top_left)),
            ("it matches a softmax over the query axis (dim=-2): normalise each ROW over the keys "
             "(dim=-1)", _causal_attention64(q, k, v, scale, top_left, dim=-2)),
        ]
        _diagnose(f"{name}(...) output", got, want, mistakes, atol=1e-5, rtol=1e-5, where=where)
    passed(f"{name} matches float64 causal attention on {len(cases)} shapes "
           "(N_q = N_kv, N_q < N_kv, N_q > N_kv, 3-D and 4-D inputs, several scales)")


def check_score_bytes(fn):
    """Chapter 00: ``fn(batch, heads, n, dtype)`` must return the bytes of S and P together: two
    tensors of shape (batch, heads, n, n) in ``dtype``."""
    name = getattr(fn, "__name__", "score_bytes")
    cases = [(1, 1, 1, torch.float32), (2, 8, 1024, torch.float16), (1, 32, 8192, torch.bfloat16),
             (4, 16, 4096, torch.float32), (3, 5, 17, torch.float64), (1, 1, 131072, torch.float16),
             (7, 3, 100, torch.bfloat16)]
    for b, h, n, dtype in cases:
        got = attempt(fn, b, h, n, dtype, name=name)
        size = torch.empty((), dtype=dtype).element_size()
        want = 2 * b * h * n * n * size
        call = f"{name}({b}, {h}, {n}, {dtype})"
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise ExerciseError(f"{call} returned {type(got).__name__}; return a number of bytes "
                                "(an int)") from None
        if value != round(value):
            raise ExerciseError(f"{call} returned {value}, which is not a whole number of bytes")
        value = int(round(value))
        if value == want:
            continue
        hints = {want // 2: "that is the size of ONE matrix: count S and P (two of them)",
                 2 * b * h * n * n * 4: f"that assumes 4 bytes per element; {dtype} has {size} "
                                        "(torch.empty((), dtype=dtype).element_size())",
                 2 * b * h * n * size: "S is N x N per (batch, head): the length appears squared",
                 2 * n * n * size: "S and P exist for every batch and every head: multiply by both",
                 want * 8: "that is bits; divide by 8 for bytes (or use element_size(), in bytes)"}
        hint = hints.get(value) if value != want else None
        raise ExerciseError(f"{call} returned {value:,}, expected {want:,}" + (f": {hint}" if hint else ""))
    passed(f"{name} gives the exact bytes of S and P on {len(cases)} cases "
           "(float16, bfloat16, float32, float64; N from 1 to 131072)")


def _row_pieces(g, rows, n, scale, shift=0.0):
    return torch.randn(rows, n, generator=g, dtype=torch.float64) * scale + shift


def _state(x):
    """(M, L) of each row of x in float64; an empty piece gives (-inf, 0)."""
    if x.shape[-1] == 0:
        return (torch.full(x.shape[:-1], float("-inf"), dtype=torch.float64),
                torch.zeros(x.shape[:-1], dtype=torch.float64))
    m = x.max(-1).values
    return m, torch.exp(x - m[..., None]).sum(-1)


def check_merge_softmax_states(fn):
    """Chapter 01: ``fn(m_a, l_a, m_b, l_b)`` must return the state ``(m, l)`` of the two pieces
    together: m the larger max, l the sum of e^(x - m) over both. An empty piece has state
    (-inf, 0); merging two empty pieces must give (-inf, 0), not NaN."""
    name = getattr(fn, "__name__", "merge_softmax_states")
    g = torch.Generator().manual_seed(1)
    total = 0
    stages = [("pieces of similar size", [(4, 7, 5, 1.0, 0.0), (3, 1, 9, 3.0, 0.0), (5, 16, 16, 30.0, 0.0)]),
              ("pieces whose maxima differ a lot", [(4, 6, 6, 1.0, 40.0), (4, 6, 6, 1.0, -40.0),
                                                    (3, 11, 2, 300.0, 0.0)]),
              ("one empty piece (state (-inf, 0))", [(3, 0, 5, 2.0, 0.0), (3, 5, 0, 2.0, 0.0)]),
              ("two empty pieces", [(2, 0, 0, 1.0, 0.0)])]
    for stage, cases in stages:
        for rows, n_a, n_b, scale, shift in cases:
            a, b = _row_pieces(g, rows, n_a, scale, shift), _row_pieces(g, rows, n_b, scale)
            m_a, l_a = _state(a)
            m_b, l_b = _state(b)
            m_want, l_want = _state(torch.cat([a, b], -1))
            if n_a + n_b == 0:
                l_want = torch.zeros_like(l_want)
            m, l = _result(fn, m_a.clone(), l_a.clone(), m_b.clone(), l_b.clone(), name=name, count=2)
            where = f" (case: {stage}; pieces of {n_a} and {n_b} elements, {rows} rows)"
            if n_a + n_b == 0 and torch.isnan(torch.as_tensor(l).double()).any():
                raise ExerciseError(
                    f"{name} returns l = NaN when both pieces are empty{where}. With m = -inf, "
                    "e^(m_a - m) = e^(-inf - (-inf)) = e^NaN. Rescale against a finite stand-in "
                    "when m is -inf, e.g. m_safe = torch.where(m == -inf, 0, m): then both terms "
                    "are 0 * e^(-inf) = 0, as an empty sum should be.")
            if n_a * n_b == 0 and n_a + n_b > 0 and torch.isnan(torch.as_tensor(l).double()).any():
                raise ExerciseError(
                    f"{name} returns NaN when one piece is empty{where}: the empty piece has m = -inf "
                    "and l = 0, so l * e^(m_empty - m) = 0 * e^(-inf) = 0 should drop it. Compute "
                    "e^(m_a - m) with m = max(m_a, m_b), not e^(m_a - m_b) or similar.")
            l_t = torch.as_tensor(l).double()
            if l_t.shape == l_want.shape and (torch.isinf(l_t) & torch.isfinite(l_want)).any():
                raise ExerciseError(
                    f"{name} returns l = inf{where}: a factor like e^(m_a - m_b) overflows when the "
                    "maxima are far apart. Rescale each sum to the common max m = max(m_a, m_b): "
                    "the factors e^(m_a - m) and e^(m_b - m) are at most 1.")
            _diagnose(f"{name}: m", m, m_want, [
                ("m must be the LARGER of the two maxima (torch.maximum), not the smaller",
                 torch.minimum(m_a, m_b))], atol=0.0, rtol=1e-12, where=where)
            _diagnose(f"{name}: l", l, l_want, [
                ("l equals l_a + l_b: the two sums are relative to different maxima, so each must "
                 "be rescaled to the common max first: l = l_a * e^(m_a - m) + l_b * e^(m_b - m)",
                 l_a + l_b),
                ("only l_b was rescaled: l_a also needs the factor e^(m_a - m)",
                 l_a + l_b * torch.exp(m_b - torch.maximum(m_a, m_b))),
                ("only l_a was rescaled: l_b also needs the factor e^(m_b - m)",
                 l_a * torch.exp(m_a - torch.maximum(m_a, m_b)) + l_b),
                ("the factors have the wrong sign: use e^(m_a - m) <= 1, not e^(m - m_a)",
                 l_a * torch.exp(torch.maximum(m_a, m_b) - m_a) + l_b * torch.exp(torch.maximum(m_a, m_b) - m_b)),
            ], atol=1e-12, rtol=1e-10, where=where)
            total += 1
    passed(f"{name} merges softmax states correctly in {total} cases, including pieces whose maxima "
           "differ by 40 and empty pieces")


def _stream(s, v, block, variant=None):
    """Online softmax(s) @ v over blocks of columns, with deliberate mistakes for the diagnosis."""
    rows, n = s.shape
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(rows, dtype=torch.float64)
    acc = torch.zeros(rows, v.shape[-1], dtype=torch.float64)
    end = n - n % block if variant == "drop_tail" else n
    for start in range(0, end, block):
        sb, vb = s[:, start:start + block], v[start:start + block]
        m_new = torch.maximum(m, sb.max(-1).values)
        p = torch.exp(sb - m_new[:, None])
        alpha = torch.exp(m - m_new)
        l = (l if variant in ("no_alpha_l", "no_alpha") else l * alpha) + p.sum(-1)
        acc = (acc if variant in ("no_alpha_acc", "no_alpha") else acc * alpha[:, None]) + p @ vb
        m = m_new
    return acc / l[:, None], m, l


def _stream_cases(g):
    """(scores, values, block, what) for the online-softmax checkers: ragged blocks, one block,
    block 1, ascending rows (the max keeps rising), huge scores, masked (-inf) scores."""
    cases = []
    for rows, n, d, block, what in [(1, 1, 1, 1, "one score"), (3, 10, 4, 4, "a ragged last block"),
                                    (5, 37, 8, 8, "37 scores in blocks of 8"),
                                    (2, 19, 5, 19, "a single block"), (2, 19, 5, 32, "block > N"),
                                    (6, 50, 7, 1, "blocks of 1")]:
        s = torch.randn(rows, n, generator=g, dtype=torch.float64) * 3
        cases.append((s, torch.randn(n, d, generator=g, dtype=torch.float64), block, what))
    s = torch.sort(torch.randn(4, 40, generator=g, dtype=torch.float64) * 4, dim=-1).values
    cases.append((s, torch.randn(40, 6, generator=g, dtype=torch.float64), 8,
                  "ascending rows, so the max rises in every block"))
    s = torch.randn(3, 30, generator=g, dtype=torch.float64) * 100 + 1000
    cases.append((s, torch.randn(30, 4, generator=g, dtype=torch.float64), 8,
                  "huge scores around 1000: e^1000 overflows even float64 unless the max is "
                  "subtracted first"))
    s = torch.randn(4, 33, generator=g, dtype=torch.float64) * 2
    hide = torch.rand(4, 33, generator=g) < 0.4
    hide[:, 0] = False  # every row keeps a finite score in its first block
    cases.append((s.masked_fill(hide, float("-inf")), torch.randn(33, 5, generator=g, dtype=torch.float64),
                  8, "masked scores (-inf), never a whole first block"))
    return cases


def check_online_softmax(fn):
    """Chapter 01: ``fn(x, block)`` must return softmax(x) over the last dim of the 2-D ``x``,
    computing M and L in one streaming pass over blocks of ``block`` columns."""
    name = getattr(fn, "__name__", "online_softmax")
    g = torch.Generator().manual_seed(2)
    cases = _stream_cases(g)
    for s, _, block, what in cases:
        got = _result(fn, s.clone(), block, name=name)
        want = torch.softmax(s, -1)
        where = f" (case: {what}; x of shape {tuple(s.shape)}, block {block})"
        got_t = torch.as_tensor(got).double()
        if got_t.shape == want.shape and not torch.isfinite(got_t).all():
            raise ExerciseError(f"{name} returned inf or NaN{where}. Subtract the running max M "
                                "before exp, and start from M = -inf, L = 0.")
        wrong_l = _stream(s, torch.eye(s.shape[-1], dtype=torch.float64), block, "no_alpha_l")
        mistakes = [("the probabilities match an L that was never rescaled: when M grows, the old L "
                     "must be multiplied by alpha = e^(M_old - M_new) before adding the new block",
                     torch.exp(s - wrong_l[1][:, None]) / wrong_l[2][:, None]),
                    ("the last, shorter block was left out: loop with range(0, N, block) and slice "
                     "x[:, start:start + block]",
                     None if s.shape[-1] % block == 0 or block > s.shape[-1] else
                     _stream(s, torch.eye(s.shape[-1], dtype=torch.float64), block, "drop_tail")[0])]
        _diagnose(f"{name} probabilities", got, want, mistakes, atol=1e-10, rtol=1e-8, where=where)
    passed(f"{name} equals torch.softmax on {len(cases)} cases (ragged blocks, rising maxima, "
           "huge and masked scores)")


def check_online_softmax_weighted_sum(fn):
    """Chapter 01: ``fn(s, v, block)`` must return softmax(s) @ v for 2-D scores ``s`` (R, N) and
    values ``v`` (N, D), streaming over blocks of ``block`` columns with M, L and a rescaled
    accumulator, dividing by L once at the end."""
    name = getattr(fn, "__name__", "online_softmax_weighted_sum")
    g = torch.Generator().manual_seed(3)
    cases = _stream_cases(g)
    for s, v, block, what in cases:
        got = _result(fn, s.clone(), v.clone(), block, name=name)
        want = torch.softmax(s, -1) @ v
        where = f" (case: {what}; s of shape {tuple(s.shape)}, v {tuple(v.shape)}, block {block})"
        got_t = torch.as_tensor(got).double()
        if got_t.shape == want.shape and not torch.isfinite(got_t).all():
            raise ExerciseError(f"{name} returned inf or NaN{where}. Subtract the running max M "
                                "before exp, start from M = -inf, L = 0, O = 0, and divide by L only "
                                "at the end.")
        ragged = s.shape[-1] % block != 0 and block < s.shape[-1]
        mistakes = [
            ("the accumulator O was not rescaled: when M grows, multiply O by alpha = "
             "e^(M_old - M_new) before adding P_block @ V_block", _stream(s, v, block, "no_alpha_acc")[0]),
            ("L was not rescaled: when M grows, multiply L by alpha = e^(M_old - M_new) before adding "
             "the block's sum", _stream(s, v, block, "no_alpha_l")[0]),
            ("neither L nor O was rescaled by alpha = e^(M_old - M_new) when the max grew",
             _stream(s, v, block, "no_alpha")[0]),
            ("the last, shorter block was left out: loop with range(0, N, block)",
             _stream(s, v, block, "drop_tail")[0] if ragged else None)]
        _diagnose(f"{name} output", got, want, mistakes, atol=1e-10, rtol=1e-8, where=where)
    passed(f"{name} equals softmax(s) @ v on {len(cases)} cases (ragged blocks, rising maxima, "
           "huge and masked scores)")


LN2 = float(np.log(2.0))
LOG2E = 1.0 / LN2


def check_lse_from_state(fn):
    """Chapter 02: ``fn(m2, l)`` gets a row state in base 2 (``m2`` the max of x * log2e, ``l`` the
    sum of 2^(x * log2e - m2)) and must return the natural-log LSE of x, like torch.logsumexp.
    Empty rows (m2 = -inf, l = 0) must give -inf."""
    name = getattr(fn, "__name__", "lse_from_state")
    g = torch.Generator().manual_seed(4)
    count = 0
    for rows, n, scale, shift in [(5, 13, 1.0, 0.0), (4, 64, 10.0, 0.0), (3, 7, 1.0, 300.0),
                                  (3, 50, 30.0, -200.0), (1, 1, 1.0, 0.0)]:
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) * scale + shift
        if n > 1:
            x[0, 1:] = float("-inf")  # a row with a single visible score
        y = x * LOG2E
        m2 = y.max(-1).values
        l = torch.exp2(y - m2[:, None]).sum(-1)
        if rows > 2:  # an empty (fully masked) row
            m2[-1], l[-1] = float("-inf"), 0.0
        want = torch.logsumexp(x, -1)
        if rows > 2:
            want[-1] = float("-inf")
        got = _result(fn, m2.clone(), l.clone(), name=name)
        where = f" (rows with scores of size about {scale:g} around {shift:g})"
        got_t = torch.as_tensor(got).double()
        if got_t.shape == want.shape and torch.isnan(got_t).any():
            raise ExerciseError(f"{name} returned NaN{where}; an empty row (m2 = -inf, l = 0) should "
                                "give -inf: (-inf + log2(0)) * ln 2 = -inf needs no special case")
        lse2 = m2 + torch.log2(l)
        _diagnose(f"{name} output", got, want, [
            ("it equals the base-2 value LSE2 = m2 + log2(l): convert to natural log by multiplying "
             "by ln 2", lse2),
            ("it matches m2 + ln(l): m2 is in base 2 and l sums powers of 2, so use log2(l), then "
             "multiply the whole LSE2 = m2 + log2(l) by ln 2", m2 + torch.log(l)),
            ("it matches LSE2 / ln 2: from base 2 to natural log you MULTIPLY by ln 2 "
             "(ln y = log2(y) * ln 2)", lse2 / LN2),
            ("it matches m2 * ln 2 + log2(l): convert the whole sum m2 + log2(l), not only m2",
             m2 * LN2 + torch.log2(l)),
        ], atol=1e-9, rtol=1e-9, where=where)
        count += 1
    passed(f"{name} turns base-2 states into torch.logsumexp on {count} cases, including huge "
           "scores, single-score rows and empty rows")


def check_softmax_exp2(fn):
    """Chapter 02: ``fn(s, scale)`` gets raw scores s = q k^T (2-D, masked entries -inf, never a
    whole row) and must return softmax(s * scale) over the last dim, computed with exp2 and the
    folded scale qk_scale = scale * log2e."""
    name = getattr(fn, "__name__", "softmax_exp2")
    g = torch.Generator().manual_seed(5)
    count = 0
    for rows, n, size, scale in [(1, 1, 1.0, 0.125), (4, 9, 3.0, 0.5), (5, 40, 8.0, 1 / 8 ** 0.5),
                                 (3, 17, 5000.0, 0.3), (6, 33, 5.0, 1.7)]:
        s = torch.randn(rows, n, generator=g, dtype=torch.float64) * size
        if n > 4:
            hide = torch.rand(rows, n, generator=g) < 0.3
            hide[:, 2] = False  # never a whole row
            s = s.masked_fill(hide, float("-inf"))
        want = torch.softmax(s * scale, -1)
        got = _result(fn, s.clone(), scale, name=name)
        where = f" (scores of size about {size:g}, scale {scale:.3g}, shape {tuple(s.shape)})"
        got_t = torch.as_tensor(got).double()
        if got_t.shape == want.shape and not torch.isfinite(got_t).all():
            raise ExerciseError(f"{name} returned inf or NaN{where}: subtract the row max of "
                                "s * qk_scale before exp2 (masked -inf scores then give 2^-inf = 0)")
        _diagnose(f"{name} probabilities", got, want, [
            ("it matches softmax(s * scale * ln 2): exp2 needs the exponent in base 2, so multiply "
             "by qk_scale = scale * log2e (LOG2E = 1 / ln 2), not by scale alone",
             torch.softmax(s * scale * LN2, -1)),
            ("it matches softmax(s): the softmax scale is missing; use qk_scale = scale * log2e",
             torch.softmax(s, -1)),
            ("it matches softmax(s * log2e): the exponent of exp2 should be s * scale * log2e",
             torch.softmax(s * LOG2E, -1)),
            ("it matches softmax(s * scale * log2e) (computed with e^x): with exp2 the factor "
             "log2e is exactly what turns 2^x back into e^(s * scale); did you use exp instead?",
             torch.softmax(s * scale * LOG2E, -1)),
        ], atol=1e-10, rtol=1e-8, where=where)
        count += 1
    passed(f"{name} equals torch.softmax(s * scale) on {count} cases, including huge and masked scores")


# --- Chapters 03-04: tiling and causal blocks; the forward kernel ----------------------------------

def _tile_kinds_by_definition(n_q, n_kv, block_q, block_kv, is_causal):
    """Tile kinds from the definition, pair by pair. A tile holds the BLOCK_Q query rows of its
    block (the kernel computes all of them, even past n_q, and stores only the real ones) and the
    BLOCK_KV key columns of its block; a pair (i, j) exists when key j is inside the sequence
    (j < n_kv) and, if causal, j <= i. Full: every pair exists; skipped: none; masked: some."""
    from .traversal import FULL, MASKED, SKIPPED, cdiv

    nqb, nkb = cdiv(n_q, block_q), cdiv(n_kv, block_kv)
    i = np.arange(nqb * block_q)[:, None]
    j = np.arange(nkb * block_kv)[None, :]
    exists = (j < n_kv) & ((j <= i) | (not is_causal))
    tiles = exists.reshape(nqb, block_q, nkb, block_kv)
    every, some = tiles.all(axis=(1, 3)), tiles.any(axis=(1, 3))
    return np.where(every, FULL, np.where(some, MASKED, SKIPPED)).astype(np.int8), exists


def _classify_cases():
    """(n_q, n_kv, block_q, block_kv, is_causal): aligned, ragged, N_q != N_kv, BLOCK_Q != BLOCK_KV,
    one-element sequences, and random ones (fixed seed)."""
    cases = [(64, 64, 16, 16), (69, 69, 32, 16), (69, 69, 16, 32), (17, 113, 32, 32), (113, 17, 32, 16),
             (40, 100, 16, 16), (100, 40, 8, 16), (1, 1, 16, 16), (5, 70, 4, 8), (200, 130, 64, 16),
             (128, 128, 64, 64), (96, 33, 32, 64), (33, 96, 64, 32)]
    rng = np.random.default_rng(3)
    for _ in range(40):
        cases.append((int(rng.integers(1, 160)), int(rng.integers(1, 160)),
                      int(2 ** rng.integers(2, 7)), int(2 ** rng.integers(2, 7))))
    return [(*c, causal) for c in cases for causal in (True, False)]


def _why_tile(kind, want, qb, kb, exists, n_q, n_kv, block_q, block_kv):
    """One pair of the tile that shows why its kind is ``want``, in words."""
    from .traversal import FULL

    rows = range(qb * block_q, (qb + 1) * block_q)
    cols = range(kb * block_kv, (kb + 1) * block_kv)
    tile = exists[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv]
    def row(i):
        return f"query {i}" + (" (a padding row of the last block)" if i >= n_q else "")
    if want == FULL or (kind == FULL and tile.any()):
        if want == FULL:
            return f"every query {rows.start}..{rows.stop - 1} sees every key {cols.start}..{cols.stop - 1}"
        r, c = np.argwhere(~tile)[0]
        i, j = rows.start + r, cols.start + c
        why = f"key {j} is past the end (n_kv = {n_kv})" if j >= n_kv else f"{row(i)} does not see key {j} (j > i)"
        return f"not every pair exists: {why}"
    if tile.any():
        r, c = np.argwhere(tile)[0]
        return f"some pairs exist: {row(rows.start + r)} sees key {cols.start + c}"
    return (f"no pair exists: the last row of the block, {rows.stop - 1}, sees keys up to {rows.stop - 1}, "
            f"and this tile starts at key {cols.start}" if cols.start < n_kv else
            f"no pair exists: key {cols.start} is past the end (n_kv = {n_kv})")


def check_classify_tiles(classify):
    """Chapter 03: ``classify(n_q, n_kv, block_q, block_kv, is_causal)`` must return the forward
    kernel's tile map, an integer array of shape (query blocks, key blocks) holding 2 (full),
    1 (masked) or 0 (skipped). Compared with the definition on about a hundred cases."""
    from .plotting import TILE_NAMES

    cases = _classify_cases()
    for n_q, n_kv, block_q, block_kv, causal in cases:
        call = f"classify({n_q}, {n_kv}, {block_q}, {block_kv}, is_causal={causal})"
        want, exists = _tile_kinds_by_definition(n_q, n_kv, block_q, block_kv, causal)
        got = attempt(classify, n_q, n_kv, block_q, block_kv, causal, name="classify")
        try:
            got = np.asarray(got)
        except Exception:
            raise ExerciseError(f"{call} should return an array, got {type(got).__name__}") from None
        if got.shape != want.shape:
            raise ExerciseError(f"{call} returned shape {got.shape}; expected {want.shape} = "
                                f"(cdiv({n_q}, {block_q}), cdiv({n_kv}, {block_kv})): one entry per tile, "
                                "a ragged last block counts as a whole block")
        if not np.isin(got, (0, 1, 2)).all():
            raise ExerciseError(f"{call} returned values {sorted(set(got.ravel().tolist()))}; "
                                "use only 0 (skipped), 1 (masked) and 2 (full)")
        wrong = got != want
        if not wrong.any():
            continue
        qb, kb = (int(x) for x in np.argwhere(wrong)[0])
        message = (f"{call} is wrong at {int(wrong.sum())} of {want.size} tiles. First: tile "
                   f"(query block {qb}, key block {kb}), queries {qb * block_q}..{(qb + 1) * block_q - 1}, "
                   f"keys {kb * block_kv}..{(kb + 1) * block_kv - 1}: you said {TILE_NAMES.get(int(got[qb, kb]))!r}, "
                   f"it is {TILE_NAMES[int(want[qb, kb])]!r} because "
                   + _why_tile(int(got[qb, kb]), int(want[qb, kb]), qb, kb, exists, n_q, n_kv, block_q, block_kv)
                   + ". The wrong tiles are outlined in red on the left.")
        import matplotlib.pyplot as plt

        from .plotting import tile_kinds_map

        fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
        tile_kinds_map(got, n_q, n_kv, block_q, block_kv, causal, ax=axes[0], wrong=wrong, title="yours")
        tile_kinds_map(want, n_q, n_kv, block_q, block_kv, causal, ax=axes[1], title="expected")
        fig.suptitle(call, fontsize=10)
        fig.tight_layout()
        plt.show()
        raise ExerciseError(message)
    passed(f"classify gives the right tile map in all {len(cases)} cases (ragged, N_q != N_kv, "
           "BLOCK_Q != BLOCK_KV, causal and not)")


def _fwd_simulate(q, k, v, is_causal, block_q, block_kv, scale, mistake=None):
    """The forward kernel's tile loop in float64, exactly as flashattn runs it (keys padded to
    whole tiles), optionally with one classic mistake. Returns (out, natural lse, tiles computed).

    mistake: None, "alpha_acc" (acc not rescaled), "alpha_l" (L not rescaled), "causal" (no causal
    mask), "ragged" (keys past the end not hidden: they score 0), "exp" (exp where exp2 belongs),
    "per_tile" (each tile's P normalised on its own)."""
    from .traversal import cdiv, kv_ranges

    q, k, v = q.double(), k.double(), v.double()
    n_q, n_kv = q.shape[-2], k.shape[-2]
    pad = cdiv(n_kv, block_kv) * block_kv - n_kv
    kp = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, k.shape[-1])], -2)
    vp = torch.cat([v, v.new_zeros(*v.shape[:-2], pad, v.shape[-1])], -2)
    log2e = 1.0 / np.log(2.0)
    qk_scale = scale * log2e
    exp = torch.exp if mistake == "exp" else torch.exp2
    out = torch.zeros_like(q)
    lse = q.new_zeros(q.shape[:-1])
    tiles = 0
    for q_start in range(0, n_q, block_q):
        rows = torch.arange(q_start, min(q_start + block_q, n_q))
        m = q.new_full((*q.shape[:-2], len(rows)), float("-inf"))
        l = q.new_zeros(m.shape)
        acc = q.new_zeros((*m.shape, q.shape[-1]))
        full_end, end = kv_ranges(q_start, block_q, block_kv, n_kv, is_causal)
        for kv_start in range(0, end, block_kv):
            tiles += 1
            cols = torch.arange(kv_start, kv_start + block_kv)
            s = q[..., rows, :] @ kp[..., cols, :].transpose(-2, -1)
            visible = torch.ones(len(rows), block_kv, dtype=torch.bool)
            if mistake != "ragged":
                visible &= cols[None, :] < n_kv
            if is_causal and mistake != "causal":
                visible &= cols[None, :] <= rows[:, None]
            s = s.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1) * qk_scale)
            p = exp(s * qk_scale - m_new[..., None]).nan_to_num(0.0)
            alpha = exp(m - m_new).nan_to_num(0.0)
            if mistake == "per_tile":
                p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
            l = (l if mistake == "alpha_l" else l * alpha) + p.sum(-1)
            acc = (acc if mistake == "alpha_acc" else acc * alpha[..., None]) + p @ vp[..., cols, :]
            m = m_new
        out[..., rows, :] = acc / l[..., None]
        lse[..., rows] = (m + torch.log2(l)) / log2e
    return out, lse, tiles


_FWD_MISTAKES = {
    "alpha_acc": "the accumulated output is not rescaled by alpha = exp(M_old - M_new) (2**(M_old - "
                 "M_new) in base 2) when the running max grows: acc = acc * alpha + P V",
    "alpha_l": "the running sum L is not rescaled by alpha when the running max grows "
               "(L = L * alpha + rowsum(P))",
    "causal": "the causal mask is missing on the diagonal tiles: query i must not see keys j > i",
    "ragged": "keys past the end of the sequence are not hidden: they score 0 instead of -inf, "
              "so they still get probability",
    "exp": "exp is used where exp2 belongs (the scores were multiplied by log2(e): use exp2, or "
           "leave out the log2(e))",
    "per_tile": "each tile's probabilities are normalised on their own; divide by L once, at the end",
}


def _name_fwd_mistake(got, q, k, v, is_causal, block_q, block_kv, scale, want, atol, rtol):
    for mistake, hint in _FWD_MISTAKES.items():
        wrong = _fwd_simulate(q, k, v, is_causal, block_q, block_kv, scale, mistake)[0]
        if not _close(wrong, want, atol, rtol) and _close(got, wrong, atol, rtol):
            return hint
    return None


def check_tiled_attention(tiled_attention):
    """Chapter 03: ``tiled_attention(q, k, v, is_causal, block_q, block_kv) -> (out, lse, n_tiles)``
    for one head, q (N_q, D), k and v (N_kv, D) in float64, scale 1/sqrt(D): the kernel's loop in
    PyTorch with the online softmax in natural base; ``lse`` in natural log; ``n_tiles`` the number
    of tiles whose scores were computed (the skipped ones must not be)."""
    from .reference import naive_attention
    from .traversal import SKIPPED, classify_blocks

    cases = [(64, 64, 16, 32, 16, False), (69, 69, 24, 32, 16, False), (69, 69, 24, 32, 16, True),
             (69, 69, 16, 16, 32, True), (17, 113, 8, 32, 32, True), (113, 17, 8, 32, 16, True),
             (40, 100, 16, 16, 16, False), (1, 1, 4, 16, 16, True), (50, 50, 16, 8, 8, True)]
    g = torch.Generator().manual_seed(33)
    for n, (n_q, n_kv, d, block_q, block_kv, causal) in enumerate(cases):
        spread = 6.0 if n % 3 == 2 else 1.0  # large scores: a missing max subtraction overflows
        q = torch.randn(n_q, d, generator=g, dtype=torch.float64) * spread
        k = torch.randn(n_kv, d, generator=g, dtype=torch.float64) * spread
        v = torch.randn(n_kv, d, generator=g, dtype=torch.float64)
        what = (f" (N_q={n_q}, N_kv={n_kv}, D={d}, block_q={block_q}, block_kv={block_kv}, "
                f"is_causal={causal})")
        result = attempt(tiled_attention, q.clone(), k.clone(), v.clone(), causal, block_q, block_kv,
                         name="tiled_attention")
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise ExerciseError("tiled_attention should return a tuple (out, lse, n_tiles), got "
                                f"{type(result).__name__}")
        out, lse, n_tiles = result
        out_ref, lse_ref = naive_attention(q, k, v, is_causal=causal)
        scale = 1.0 / d ** 0.5
        hint = None if _close(out, out_ref, 1e-9, 1e-9) else _name_fwd_mistake(
            out, q, k, v, causal, block_q, block_kv, scale, out_ref, 1e-9, 1e-9)
        if hint:
            raise ExerciseError(f"out is wrong{what}: it equals what you get when {hint}.")
        expect_close(f"out{what}", out, out_ref, atol=1e-9, rtol=1e-9, heatmap=True)
        expect_close(f"lse{what}", lse, lse_ref, atol=1e-9, rtol=1e-9)
        kinds = classify_blocks(n_q, n_kv, block_q, block_kv, causal)
        computed = int((kinds != SKIPPED).sum())
        try:
            n_tiles = int(n_tiles)
        except Exception:
            raise ExerciseError(f"n_tiles should be an int, got {type(n_tiles).__name__}") from None
        if n_tiles != computed:
            raise ExerciseError(f"n_tiles is {n_tiles}{what}, but the kernel computes {computed} of the "
                                f"{kinds.size} tiles ({int((kinds == SKIPPED).sum())} are skipped). "
                                "Count each (query block, key block) whose scores you compute, and "
                                "compute only the tiles that are not skipped.")
    passed(f"tiled_attention matches the float64 reference in {len(cases)} cases and computes "
           "exactly the tiles that are not skipped")


def check_kv_stage_bounds(kv_stage_bounds):
    """Chapter 04: ``kv_stage_bounds(q_start, block_q, block_kv, n_kv, is_causal)`` must return
    ``(kv_full_end, kv_end)`` for the query block starting at ``q_start``: keys [0, kv_full_end)
    in whole tiles that need no mask, keys [kv_full_end, kv_end) with the mask, none after."""
    from .traversal import kv_ranges

    count = 0
    for n_kv in (1, 15, 16, 17, 64, 69, 100, 113, 128):
        for n_q in (1, 40, 69, 128):
            for block_q, block_kv in ((16, 16), (32, 16), (16, 32), (64, 32), (32, 64), (128, 64)):
                for causal in (True, False):
                    for q_start in range(0, n_q, block_q):
                        count += 1
                        call = (f"kv_stage_bounds(q_start={q_start}, block_q={block_q}, "
                                f"block_kv={block_kv}, n_kv={n_kv}, is_causal={causal})")
                        got = attempt(kv_stage_bounds, q_start, block_q, block_kv, n_kv, causal,
                                      name="kv_stage_bounds")
                        try:
                            full_end, end = (int(x) for x in got)
                        except Exception:
                            raise ExerciseError(f"{call} should return two ints (kv_full_end, kv_end), "
                                                f"got {got!r}") from None
                        want_full, want_end = kv_ranges(q_start, block_q, block_kv, n_kv, causal)
                        if (full_end, end) == (want_full, want_end):
                            continue
                        last = q_start + block_q - 1
                        if end != want_end:
                            if end > n_kv:
                                why = f"keys from n_kv = {n_kv} on do not exist"
                            elif causal and end > want_end:
                                why = (f"the last query of the block, {last}, sees keys up to {last}: "
                                       f"keys from {want_end} on are skipped, never loaded")
                            else:
                                why = (f"key {end} is seen by some query of the block "
                                       f"{q_start}..{last}, so it must be visited")
                            raise ExerciseError(f"{call} returned kv_end = {end}; expected {want_end}: {why}.")
                        if full_end % block_kv:
                            why = (f"stage 1 loads whole tiles with no mask, so kv_full_end must be a "
                                   f"multiple of BLOCK_KV = {block_kv}")
                        elif full_end > want_full:
                            j = full_end - 1
                            why = (f"the tile ending at key {j} needs a mask: "
                                   + (f"key {j} is past the end" if j >= n_kv else
                                      f"query {q_start} (the first of the block) does not see key {j}"))
                        else:
                            why = (f"keys {full_end}..{want_full - 1} are seen by every query of the "
                                   "block, in whole tiles, so they belong to the fast stage without a mask "
                                   "(masking them gives the same numbers, only slower: yours masks more "
                                   "than needed)")
                        raise ExerciseError(f"{call} returned kv_full_end = {full_end}; expected {want_full}: {why}.")
    passed(f"kv_stage_bounds gives the kernel's two stages in all {count} cases")


import triton  # noqa: E402  (flashattn/__init__.py, run before this module, has picked the runtime)
import triton.language as tl  # noqa: E402

from .forward import kv_stage_bounds  # noqa: E402


@triton.jit
def fwd_exercise_kernel(Q, K, V, O, LSE,
                        stride_qh, stride_qn, stride_kh, stride_kn, stride_kd,
                        stride_vh, stride_vn, stride_vd, stride_oh, stride_on,
                        n_q, n_kv, qk_scale, INNER: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """flashattn's forward kernel, simplified, around a learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time argument). Tensors are (heads, N, D) with a head
    dim that is a power of two >= 16 (so no column mask), Q and O with contiguous columns."""
    q_block, head = tl.program_id(0), tl.program_id(1)     # grid: (query blocks, heads)
    Q += head * stride_qh                                  # move to this head's (N, D) matrices
    K += head * stride_kh
    V += head * stride_vh
    O += head * stride_oh
    LSE += head * n_q
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)               # the query positions of this block
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_qn + offs_d[None, :], mask=offs_q[:, None] < n_q, other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)   # running max M (base 2, scaled)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)                 # running sum L
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)       # unnormalised output
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)  # flashattn's own
    # stage 1: full tiles, no mask (MASKED=False); stage 2: masked tiles (MASKED=True)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale, BLOCK_KV, False, IS_CAUSAL)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                          offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale, BLOCK_KV, True, IS_CAUSAL)
    acc = acc / l_i[:, None]
    tl.store(LSE + offs_q, m_i + tl.log2(l_i), mask=offs_q < n_q)   # base-2 LSE
    tl.store(O + offs_q[:, None] * stride_on + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=offs_q[:, None] < n_q)


def _is_stub(fn):
    """Whether the source of the learner's function (a @triton.jit one included) still holds the
    stub's ``raise NotImplementedError``."""
    import inspect
    import re

    try:
        source = inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return False
    return re.search(r"^\s*raise NotImplementedError", source, re.M) is not None


def _not_implemented(name):
    return ExerciseError(f"{name} is not implemented yet: replace `raise NotImplementedError()` "
                         "with your code, then run this check again.")


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
    import ast

    for cause in _error_chain(error):
        if isinstance(cause, NotImplementedError) and not str(cause):
            return True
        node = getattr(cause, "node", None)  # Triton's CompilationError keeps the AST node
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in ast.unparse(node.exc):
            return True
    return False


def _launch_error(error, name, constexprs):
    """The ExerciseError for a failed launch of a kernel around the learner's function ``name``."""
    if _stub_raised(error):
        return _not_implemented(name)
    text = " <- ".join(f"{type(c).__name__}: {c}" for c in _error_chain(error))
    shown = {k: v for k, v in constexprs.items() if not callable(v)}  # not the learner's function
    return ExerciseError(f"{name} failed when its kernel ran with {shown}: {text[:2000]}")


def _launch_learner_kernel(kernel, grid, args, constexprs, name, learner):
    """Launch ``kernel`` (the learner's @triton.jit ``learner`` itself, or a kernel that calls it),
    the same way on both runtimes: a stub (its source still raises NotImplementedError; or, should
    that check miss, the error of the launch says so, see _stub_raised) becomes 'not implemented
    yet', any other failure a readable ExerciseError that keeps the original error as its cause."""
    if _is_stub(learner):
        raise _not_implemented(name)
    try:
        kernel[grid](*args, **constexprs)
    except Exception as error:  # the interpreter and the compiler wrap errors raised inside
        raise _launch_error(error, name, constexprs) from error


def run_fwd_inner(fwd_inner, q, k, v, is_causal=False, scale=None, block_q=32, block_kv=16):
    """Run the forward kernel built around the learner's ``fwd_inner`` on (heads, N, D) tensors
    (any strides). Returns ``(o, lse2)``: the output like ``q`` and the base-2 LSE (float32)."""
    import math

    from .reference import LOG2E

    heads, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    lse2 = torch.full((heads, n_q), float("nan"), device=q.device, dtype=torch.float32)
    _launch_learner_kernel(fwd_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                    (q, k, v, o, lse2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
                     n_q, k.shape[1], scale * LOG2E, fwd_inner),
                    dict(HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)),
                    "fwd_inner", fwd_inner)
    return o, lse2


def check_fwd_inner(fwd_inner):
    """Chapter 04: the forward kernel's inner loop in Triton, run inside flashattn's kernel (given
    in this module) through the interpreter on tiny inputs: aligned and ragged lengths, causal and
    not, N_q != N_kv, strided keys and values, float16; output and LSE against float64."""
    import math

    from .notebook import pick
    from .reference import naive_attention
    from .runtime import DEVICE

    # (heads, n_q, n_kv, D, causal, dtype, layout, block_q, block_kv)
    cases = [(2, 64, 64, 32, False, torch.float32, "contiguous", 32, 16),
             (2, 69, 69, 32, False, torch.float32, "contiguous", 32, 16),
             (2, 69, 69, 32, True, torch.float32, "contiguous", 32, 16),
             (1, 40, 69, 16, True, torch.float32, "contiguous", 32, 16),
             (1, 69, 23, 16, True, torch.float32, "contiguous", 16, 32),
             (2, 33, 47, 16, True, torch.float32, "strided", 32, 16),
             (2, 69, 69, 32, True, torch.float16, "contiguous", 32, 16)]
    for n, (heads, n_q, n_kv, d, causal, dtype, layout, block_q, block_kv) in enumerate(cases):
        g = torch.Generator().manual_seed(440 + n)
        q = torch.randn(heads, n_q, d, generator=g).to(dtype)
        if layout == "strided":  # keys and values as (N, H, 2D) storage: row and column strides != D, 1
            k = torch.randn(n_kv, heads, 2 * d, generator=g).to(dtype).transpose(0, 1)[..., ::2]
            v = torch.randn(n_kv, heads, 2 * d, generator=g).to(dtype).transpose(0, 1)[..., 1::2]
        else:
            k, v = (torch.randn(heads, n_kv, d, generator=g).to(dtype) for _ in range(2))
        q, k, v = (t.to(DEVICE) for t in (q, k, v))
        scale = 1.0 / math.sqrt(d)
        o, lse2 = run_fwd_inner(fwd_inner, q, k, v, is_causal=causal, scale=scale,
                                block_q=block_q, block_kv=block_kv)
        o_ref, lse_ref = naive_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)
        what = (f" (heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}, {dtype}, "
                f"{layout} K/V, BLOCK_Q={block_q}, BLOCK_KV={block_kv})")
        if dtype == torch.float16:
            atol = 4e-3
        else:  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told input_precision="ieee"
            atol = pick(cpu=2e-5, gpu=5e-3)
        if not _close(o, o_ref, atol, atol):
            hint = _name_fwd_mistake(o.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, block_q, block_kv, scale,
                                     o_ref.cpu(), atol, atol)
            if hint:
                raise ExerciseError(f"the output O is wrong{what}: it equals what you get when {hint}.")
        expect_close(f"output O{what}", o, o_ref, atol=atol, rtol=atol, heatmap=True)
        expect_close(f"LSE{what} (natural log: LSE2 * ln 2)", lse2.double() * math.log(2.0), lse_ref,
                     atol=atol, rtol=atol)
    passed(f"fwd_inner gives the right O and LSE in all {len(cases)} cases (ragged, causal, "
           "N_q != N_kv, strided K/V, float16)")


# --- Chapters 05-07: the backward pass, its kernels, autograd and testing --------------------------

import triton  # noqa: E402  (flashattn/__init__.py, run before this module, has picked the runtime)
import triton.language as tl  # noqa: E402

def _bwd_gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _bwd_randn(shape, gen, dtype=torch.float64, scale=1.0):
    from .runtime import DEVICE

    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=DEVICE)


def _bwd_matches(got, want, atol=1e-9, rtol=1e-7):
    got = torch.as_tensor(got).detach().double().cpu()
    want = want.detach().double().cpu()
    return got.shape == want.shape and bool(torch.allclose(got, want, atol=atol, rtol=rtol))


# Chapter 05 --------------------------------------------------------------------------------------

def check_softmax_backward(softmax_backward):
    """``softmax_backward(p, dp) -> ds`` for P = softmax(S) along the last dim: dS = P * (dP - rowsum(P * dP)).

    Drawn inputs: several shapes (one row, one column, batched, wide), a row with hidden (-inf)
    scores whose probabilities are exactly 0; compared with torch.autograd in float64."""
    cases = [((1, 5), 0), ((4, 1), 1), ((3, 7), 2), ((2, 3, 9), 3), ((6, 33), 4), ((2, 2, 4, 17), 5)]
    for shape, seed in cases:
        g = _bwd_gen(100 + seed)
        s = _bwd_randn(shape, g, scale=2.0)
        if seed % 2 and shape[-1] > 3:
            s[..., -2:] = float("-inf")  # hidden keys: P = 0 there, and so is their gradient
        s.requires_grad_(True)
        p = torch.softmax(s, dim=-1)
        dp = _bwd_randn(shape, g)
        (want,) = torch.autograd.grad(p, s, dp)
        want = torch.nan_to_num(want)  # hidden scores get a zero gradient
        p_in, dp_in = p.detach().clone(), dp.clone()
        got = attempt(softmax_backward, p_in, dp_in, name="softmax_backward")
        if not (torch.equal(p_in, p.detach()) and torch.equal(dp_in, dp)):
            raise ExerciseError("softmax_backward changed its inputs p or dp in place; return a new tensor")
        if _bwd_matches(got, want):
            continue
        pd = p.detach()
        if _bwd_matches(got, pd * dp):
            raise ExerciseError(f"for shape {shape}, your dS equals P * dP: you forgot to subtract the row sum "
                                "rowsum(P * dP) (a softmax row sums to 1, so a change of one score moves all "
                                "the probabilities of its row).")
        if _bwd_matches(got, pd * (dp - (pd * dp).sum(-2, keepdim=True))):
            raise ExerciseError(f"for shape {shape}, you summed P * dP over the wrong dimension (dim -2, the "
                                "rows): the sum runs along each row, over the last dim, with keepdim=True.")
        if _bwd_matches(got, pd * (dp - dp.sum(-1, keepdim=True))):
            raise ExerciseError(f"for shape {shape}, you subtracted rowsum(dP); the weights of that sum are the "
                                "probabilities: rowsum(P * dP).")
        expect_close(f"dS for shape {shape}", got, want, atol=1e-9, rtol=1e-7)
    passed("softmax_backward matches torch.autograd on 6 shapes, hidden (-inf) scores included")


def _bwd_attention_case(n_q, n_kv, d, lead, is_causal, scale, seed):
    from .reference import naive_attention

    g = _bwd_gen(seed)
    q, k, v = (_bwd_randn((*lead, n, d), g).requires_grad_(True) for n in (n_q, n_kv, n_kv))
    out, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    do = _bwd_randn(out.shape, g)
    want = torch.autograd.grad(out, (q, k, v), do)
    return [t.detach() for t in (q, k, v, out)], do, lse.detach(), want


def check_attention_backward(attention_backward):
    """``attention_backward(q, k, v, o, do, lse, is_causal, scale) -> (dq, dk, dv)`` from the formulas,
    checked against torch.autograd in float64 (causal and not, N_q != N_kv, leading dims)."""
    cases = [  # n_q, n_kv, d, leading dims, causal, scale
        (7, 7, 4, (), False, 0.5), (9, 9, 8, (2,), True, None), (5, 11, 6, (1, 2), True, 0.3),
        (12, 4, 5, (2, 1), True, None), (6, 13, 3, (), False, 1.7), (1, 1, 2, (), True, None),
    ]
    for n, (n_q, n_kv, d, lead, causal, scale) in enumerate(cases):
        (q, k, v, o), do, lse, want = _bwd_attention_case(n_q, n_kv, d, lead, causal, scale, 200 + n)
        what = f"N_q={n_q}, N_kv={n_kv}, D={d}, leading dims {lead}, is_causal={causal}, scale={scale}"
        got = attempt(attention_backward, q.clone(), k.clone(), v.clone(), o.clone(), do.clone(), lse.clone(),
                      causal, scale, name="attention_backward")
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ExerciseError("attention_backward must return a tuple (dq, dk, dv)")
        sc = 1.0 / d ** 0.5 if scale is None else scale
        for name, g_, w in zip(("dq", "dk", "dv"), got, want):
            if _bwd_matches(g_, w):
                continue
            if name != "dv" and _bwd_matches(torch.as_tensor(g_) * sc, w):
                raise ExerciseError(f"{name} is wrong ({what}): it is missing the factor scale: S = scale * Q K^T, "
                                    "so dQ = scale * dS K and dK = scale * dS^T Q.")
            if name != "dv" and _bwd_matches(torch.as_tensor(g_), w * sc):
                raise ExerciseError(f"{name} is wrong ({what}): it carries the factor scale twice.")
            expect_close(f"{name} ({what})", g_, w, atol=1e-9, rtol=1e-7, heatmap=True)
    passed("attention_backward matches torch.autograd in float64 on 6 cases (causal, N_q != N_kv, leading dims)")


# Chapter 06 --------------------------------------------------------------------------------------

def check_delta_kernel(delta_kernel):
    """The Delta preprocess as a Triton kernel, launched as
    ``delta_kernel[(cdiv(n_rows, BLOCK_ROWS),)](O, dO, Delta, n_rows, stride_o, stride_do,
    HEAD_DIM=..., BLOCK_ROWS=..., BLOCK_D=...)`` on (n_rows, HEAD_DIM) matrices whose rows are
    ``stride_o``/``stride_do`` elements apart (columns contiguous). Checks ragged row counts, head dims
    that need padding, float16 inputs (which must be multiplied and summed in float32) and that
    nothing is written past the end of Delta."""
    from .runtime import DEVICE

    cases = [(1, 16, 16, torch.float32), (17, 40, 16, torch.float32), (69, 64, 32, torch.float32),
             (130, 24, 64, torch.float32), (69, 64, 16, torch.float16), (33, 40, 32, torch.float16)]
    for n, (n_rows, d, block_rows, dtype) in enumerate(cases):
        g = _bwd_gen(300 + n)
        block_d = max(16, triton.next_power_of_2(d))
        pad = block_rows + 1  # rows past the end hold NaN: a load there is harmless only if masked
        o_buf = torch.full((n_rows + pad, d + 8), float("nan"), dtype=dtype)
        do_buf = torch.full((n_rows + pad, d + 3), float("nan"), dtype=dtype)
        o_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        do_buf[:n_rows, :d] = torch.randn(n_rows, d, generator=g) * 2
        o_buf, do_buf = o_buf.to(DEVICE), do_buf.to(DEVICE)
        o, do = o_buf[:n_rows, :d], do_buf[:n_rows, :d]
        o[:, 0], do[:, 0] = 30.0, 30.0  # a large common term: float16 sums lose the small ones
        delta_buf = torch.full((n_rows + pad,), -7.0, dtype=torch.float32, device=DEVICE)
        _launch_learner_kernel(delta_kernel, (triton.cdiv(n_rows, block_rows),),
                        (o, do, delta_buf, n_rows, o.stride(0), do.stride(0)),
                        dict(HEAD_DIM=d, BLOCK_ROWS=block_rows, BLOCK_D=block_d), "delta_kernel",
                        delta_kernel)
        what = f"n_rows={n_rows}, HEAD_DIM={d}, BLOCK_ROWS={block_rows}, BLOCK_D={block_d}, {dtype}"
        if not (delta_buf[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: your kernel wrote past the end of Delta (rows >= n_rows): "
                                "mask the store with `rows < n_rows`.")
        want = (o.double() * do.double()).sum(-1)
        got = delta_buf[:n_rows]
        if torch.isnan(got).any():
            raise ExerciseError(f"{what}: Delta has NaN: some loads read outside the {n_rows} x {d} matrix "
                                "(the padded columns d >= HEAD_DIM or the rows >= n_rows need a mask, "
                                "with other=0.0).")
        if dtype == torch.float16 and not _bwd_matches(got, want, atol=2e-4, rtol=2e-5) \
                and _bwd_matches(got, want, atol=1e-2, rtol=5e-3):  # close, but not float32-close
            raise ExerciseError(f"{what}: Delta lost precision: convert O and dO to float32 before "
                                "multiplying (`.to(tl.float32)`), as the package's preprocess does.")
        expect_close(f"Delta ({what})", got, want, atol=2e-4, rtol=2e-5)
    passed("delta_kernel computes Delta = rowsum(dO * O) for ragged rows, padded head dims and float16")


@triton.jit
def dq_exercise_kernel(Q, K, V, dO, LSE, Delta, dQ,
                       stride_qh, stride_qn, stride_kh, stride_kn, stride_dqh, stride_dqn,
                       n_q, n_kv, scale, qk_scale, INNER: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The dQ stage of chapter 06's exercise, around the learner's inner loop ``INNER`` (a
    @triton.jit function passed as a compile-time constant, and called like flashattn's _dq_inner).

    One program per (query block, head) of (heads, N, D) tensors whose columns are contiguous; K and
    V share their strides, and so do Q and dO. It loads the resident tiles (q, do, and the rows' LSE2
    and Delta), then calls INNER twice with the key ranges of flashattn.traversal.kv_ranges: the
    whole unmasked tiles (MASKED=False), then the diagonal and ragged tiles (MASKED=True)."""
    q_block, head = tl.program_id(0), tl.program_id(1)
    Q += head * stride_qh
    dO += head * stride_qh
    K += head * stride_kh
    V += head * stride_kh
    dQ += head * stride_dqh
    LSE += head * n_q
    Delta += head * n_q
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_q[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    do = tl.load(dO + offs_q[:, None] * stride_qn + offs_d[None, :], mask=inside, other=0.0)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, 0, kv_full_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, False, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, offs_q, offs_d, kv_full_end, kv_end, n_kv, qk_scale,
               HEAD_DIM, BLOCK_D, BLOCK_KV, True, IS_CAUSAL)
    dq *= scale
    tl.store(dQ + offs_q[:, None] * stride_dqn + offs_d[None, :], dq, mask=inside)


def run_dq_inner(dq_inner, q, k, v, do, is_causal=False, scale=None, block_q=32, block_kv=16):
    """Run the dQ stage built around ``dq_inner`` on float32 (heads, N, D) tensors; the LSE and
    Delta come from a float64 reference. Returns dQ (float32)."""
    import math

    from .reference import LOG2E, naive_attention

    heads, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v, do = (t.float().contiguous() for t in (q, k, v, do))
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)
    lse2 = (lse64 * LOG2E).float().contiguous()
    delta = (o64 * do.double()).sum(-1).float().contiguous()
    dq = torch.full_like(q, float("nan"))
    _launch_learner_kernel(dq_exercise_kernel, (triton.cdiv(n_q, block_q), heads),
                    (q, k, v, do, lse2, delta, dq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                     dq.stride(0), dq.stride(1), n_q, k.shape[1], scale, scale * LOG2E, dq_inner),
                    dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                         BLOCK_KV=block_kv, IS_CAUSAL=bool(is_causal)), "dq_inner", dq_inner)
    return dq


def _bwd_dq_variants(q, k, v, do, is_causal, scale, block_q=32):
    """dQ in float64 for the correct formulas and for three classic mistakes (the unmasked one
    reaches only the key tiles the kernel visits: up to the end of each query block's diagonal).

    Each comes as ``(dq, size)`` with ``size = scale * |dS| @ |K|``, the sum of the magnitudes of
    the terms a kernel adds up for each element of dQ: a kernel's rounding error grows with it."""
    from .reference import causal_mask, naive_attention

    q, k, v, do = (t.double() for t in (q, k, v, do))
    o, lse = naive_attention(q, k, v, is_causal=is_causal, scale=scale)
    s = scale * q @ k.transpose(-2, -1)
    hidden = ~causal_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else torch.zeros_like(s, dtype=torch.bool)
    delta = (do * o).sum(-1, keepdim=True)
    dp = do @ v.transpose(-2, -1)
    p = torch.exp(s - lse[..., None]).masked_fill(hidden, 0.0)
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    p_unmasked = torch.exp(s - lse[..., None]).masked_fill(is_causal & (j >= (i // block_q + 1) * block_q), 0.0)
    p_natural = torch.exp((s - lse[..., None]) / 0.6931471805599453).masked_fill(hidden, 0.0)
    ds = {
        "correct": p * (dp - delta),
        "forgot Delta (dS = P * dP)": p * dp,
        "no causal mask on the diagonal tiles": p_unmasked * (dp - delta),
        "exp instead of exp2 (the LSE and qk_scale are in base 2)": p_natural * (dp - delta),
    }
    return {name: (scale * d @ k, scale * d.abs() @ k.abs()) for name, d in ds.items()}


def check_dq_inner(dq_inner):
    """The dQ stage's inner loop in Triton, run inside a given kernel on tiny inputs (ragged lengths,
    causal and not, N_q != N_kv, a padded head dim) and compared with a float64 reference."""
    from .notebook import pick
    from .runtime import DEVICE

    tol = pick(cpu=2e-5, gpu=1e-2)  # a GPU multiplies float32 tiles in TF32 by default
    cases = [(2, 69, 69, 32, True), (2, 69, 69, 32, False), (1, 45, 70, 32, True), (1, 70, 45, 40, True),
             (2, 33, 17, 16, False), (1, 1, 1, 16, True)]
    for n, (heads, n_q, n_kv, d, causal) in enumerate(cases):
        g = _bwd_gen(400 + n)
        q, k, v, do = (torch.randn(heads, m, d, generator=g).to(DEVICE) for m in (n_q, n_kv, n_kv, n_q))
        scale = 1.0 / d ** 0.5
        got = run_dq_inner(dq_inner, q, k, v, do, is_causal=causal, scale=scale)
        variants = {name: (dq.cpu(), size.cpu()) for name, (dq, size) in
                    _bwd_dq_variants(q, k, v, do, causal, scale).items()}
        want = variants["correct"][0]
        atol = tol * max(1.0, want.abs().max().item())
        what = f"heads={heads}, N_q={n_q}, N_kv={n_kv}, D={d}, is_causal={causal}"
        if _bwd_matches(got, want, atol=atol, rtol=tol):
            continue
        # Name the mistake the output matches. Its terms may be far larger than dQ itself (without
        # the causal mask, terms of size ~100 cancel to a few units), and a kernel's rounding error
        # grows with the terms it adds up, not with their sum: on a GPU, TF32 products leave errors
        # well above tol * |dQ| there. So a mistake is recognised within tol x the size of its terms.
        got64 = torch.as_tensor(got).detach().double().cpu()
        for mistake, (wrong, size) in variants.items():
            allowed = tol * (1.0 + size)
            if mistake == "correct" or ((wrong - want).abs() <= allowed).all():
                continue  # this mistake changes nothing in this case
            if got64.shape == wrong.shape and ((got64 - wrong).abs() <= allowed).all():
                raise ExerciseError(f"dQ is wrong ({what}); it equals what you get with this mistake: {mistake}.")
        expect_close(f"dQ ({what})", got, want, atol=atol, rtol=tol, heatmap=True)
    passed("dq_inner gives the right dQ for ragged lengths, causal and not, N_q != N_kv and a padded head dim")


# Chapter 07 --------------------------------------------------------------------------------------

class _bwd_ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient passing back through it is multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _bwd_rule_impls():
    """A correct implementation and subtly wrong ones, all called as impl(q, k, v, is_causal=...)."""
    from .api import attention
    from .reference import naive_attention

    def flash(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal)

    def pytorch(q, k, v, is_causal=False):
        return naive_attention(q, k, v, is_causal=is_causal)[0]

    def scale_off(q, k, v, is_causal=False):
        return attention(q, k, v, is_causal=is_causal, scale=1.01 / q.shape[-1] ** 0.5)

    def dk_off(q, k, v, is_causal=False):
        return attention(q, _bwd_ScaleGrad.apply(k, 1.02), v, is_causal=is_causal)

    def last_row_off(q, k, v, is_causal=False):
        out = attention(q, k, v, is_causal=is_causal)
        bump = torch.ones(out.shape[-2], 1, dtype=out.dtype, device=out.device)
        bump[-1] = 1.004
        return out * bump

    def sees_next_key(q, k, v, is_causal=False):
        if not is_causal:
            return attention(q, k, v)
        n_q, n_kv = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_kv, device=q.device)[None, :]
        mask = torch.zeros(n_q, n_kv, dtype=q.dtype, device=q.device).masked_fill(j > i + 1, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    right = {"flashattn.attention": flash, "plain PyTorch in the same dtype": pytorch}
    wrong = {"the kernel with a scale 1% too large": scale_off,
             "the kernel with dK 2% too large (forward exact)": dk_off,
             "the kernel with only the last query row 0.4% off": last_row_off,
             "causal attention where query i also sees key i+1": sees_next_key}
    return right, wrong


def _bwd_verdict(verdict):
    if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
        verdict = bool(verdict)
    if not isinstance(verdict, (bool, np.bool_)):
        raise ExerciseError(f"rule_test must return True or False, got {type(verdict).__name__}")
    return bool(verdict)


def check_rule_test(rule_test):
    """``rule_test(impl, q, k, v, is_causal) -> bool`` applies the tolerance rule (error against a
    float64 reference at most 2x (out) or 3x (dq, dk, dv) plain PyTorch's error in the same dtype,
    plus the floor). It must accept correct implementations and reject subtly wrong ones."""
    from .runtime import DEVICE

    right, wrong = _bwd_rule_impls()

    def inputs(n_q, n_kv, d, dtype, seed):
        g = _bwd_gen(500 + seed)
        return [torch.randn(1, 1, n, d, generator=g).to(dtype=dtype, device=DEVICE) for n in (n_q, n_kv, n_kv)]

    right_cases = [("flashattn.attention", (37, 37, 32, torch.float32, 0), True),
                   ("flashattn.attention", (37, 50, 40, torch.float16, 1), False),
                   ("flashattn.attention", (50, 23, 16, torch.bfloat16, 2), True),
                   ("plain PyTorch in the same dtype", (29, 29, 16, torch.float16, 3), True)]
    for label, shape, causal in right_cases:
        verdict = _bwd_verdict(attempt(rule_test, right[label], *inputs(*shape), is_causal=causal, name="rule_test"))
        if not verdict:
            raise ExerciseError(f"rule_test rejected a correct implementation ({label}) on N_q, N_kv, D = "
                                f"{shape[:3]}, {shape[3]}, is_causal={causal}: is the bound factor x "
                                "PyTorch's error + floor, with errors measured against float64?")
    for label, impl in wrong.items():
        verdict = _bwd_verdict(attempt(rule_test, impl, *inputs(45, 45, 32, torch.float32, 7), is_causal=True,
                                       name="rule_test"))
        if verdict:
            raise ExerciseError(f"rule_test accepted a wrong implementation: {label} (float32, causal). "
                                "Does it compare the gradients too, take the LARGEST error over all "
                                "elements, and use a bound relative to PyTorch's own error?")
    passed("rule_test accepts flashattn and PyTorch in fp32, fp16 and bf16, and rejects 4 subtly wrong "
           "implementations")


def check_row_lse_kernel(row_lse_kernel):
    """The fixed find-the-bug kernel: ``row_lse_kernel[(cdiv(n_rows, BLOCK_ROWS),)](X, LSE, n_rows,
    n_cols, stride_row, BLOCK_ROWS=..., BLOCK_COLS=...)`` writes logsumexp of each row of X."""
    from .runtime import DEVICE

    cases = [(8, 64, 4, 16), (5, 17, 4, 16), (3, 1, 4, 16), (9, 69, 8, 32), (2, 100, 4, 32), (7, 48, 4, 32)]
    for n, (n_rows, n_cols, block_rows, block_cols) in enumerate(cases):
        g = _bwd_gen(600 + n)
        x = (torch.randn(n_rows, n_cols + 5, generator=g) * 3).to(DEVICE)[:, :n_cols]
        lse = torch.full((n_rows + block_rows,), -7.0, device=DEVICE)
        _launch_learner_kernel(row_lse_kernel, (triton.cdiv(n_rows, block_rows),),
                        (x, lse, n_rows, n_cols, x.stride(0)),
                        dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), "row_lse_kernel",
                        row_lse_kernel)
        want = torch.logsumexp(x.double(), dim=-1)
        what = f"n_rows={n_rows}, n_cols={n_cols}, BLOCK_ROWS={block_rows}, BLOCK_COLS={block_cols}"
        if not (lse[n_rows:].cpu() == -7.0).all():
            raise ExerciseError(f"{what}: the kernel wrote past the end of LSE: mask the store with rows < n_rows.")
        if _bwd_matches(lse[:n_rows], want, atol=1e-5, rtol=1e-5):
            continue
        if n_cols % block_cols and n > 0:  # case 0 (n_cols a multiple of the block) passed
            raise ExerciseError(f"{what}: wrong when n_cols is not a multiple of BLOCK_COLS (right when it is). "
                                "The padded columns of the last block still count: their scores must be "
                                "-inf (probability 0), not 0.")
        expect_close(f"LSE ({what})", lse[:n_rows], want, atol=1e-5, rtol=1e-5)
    passed("row_lse_kernel is right on aligned and ragged column counts (1, 17, 69, 100)")


# Chapter 08 --------------------------------------------------------------------------------------
# Counting FLOPs and bytes; the resources of a tile configuration; choosing one for an H100/H200.

import math  # noqa: E402

_CH08_VALUES_PER_THREAD = 160      # fp32 values a thread holds before the compiler spills (tuning.fits)
_CH08_SMEM_PER_BLOCK = 227 * 1024  # shared memory one block may use on an H100/H200 (tuning.fits)
_CH08_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


def _ch08_dtype_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _ch08_bytes(batch, heads, n_q, n_kv, head_dim, mode, element_size, lse_size=4, count_lse=True):
    """The fewest bytes attention can move to or from HBM: every input read once and every output
    written once. Forward: Q, K, V read and O written (``element_size`` bytes each), the LSE written
    (float32, one per query row). Backward: Q, K, V, O, dO and the LSE read; dQ, dK, dV written.
    Intermediates of one implementation (Delta) are not counted."""
    bh = batch * heads
    rows = 2 * n_q + 2 * n_kv if mode == "fwd" else 4 * n_q + 4 * n_kv
    return bh * rows * head_dim * element_size + (lse_size * bh * n_q if count_lse else 0)


def _ch08_number(value, what):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ExerciseError(f"{what} should be a number, got {type(value).__name__}") from None


def check_attention_cost(attention_cost):
    """Chapter 08: ``attention_cost(batch, heads, n_q, n_kv, head_dim, causal, mode, dtype)`` must
    return ``(flops, bytes)``: the conventional FLOP count (``flashattn.bench.attention_flops``) and
    the minimal HBM bytes (every input read once, every output written once; the LSE in float32)."""
    from .bench import attention_flops

    name = getattr(attention_cost, "__name__", "attention_cost")
    cases = [(1, 1, 64, 64, 64, False, "fwd", torch.bfloat16),
             (1, 128, 8192, 8192, 128, True, "fwd", torch.bfloat16),
             (2, 16, 4096, 4096, 128, True, "bwd", torch.float16),
             (4, 8, 1000, 3000, 80, False, "bwd", torch.float32),
             (3, 5, 777, 129, 96, True, "fwd", torch.float32),
             (2, 4, 17, 300, 40, True, "bwd", torch.float16),
             (1, 32, 16384, 16384, 64, False, "fwd", torch.float16),
             (5, 3, 2048, 512, 256, False, "bwd", torch.bfloat16)]
    for b, h, n_q, n_kv, d, causal, mode, dtype in cases:
        call = (f"{name}({b}, {h}, {n_q}, {n_kv}, {d}, causal={causal}, mode={mode!r}, "
                f"dtype={dtype})")
        out = attempt(attention_cost, b, h, n_q, n_kv, d, causal, mode, dtype, name=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{call} should return a tuple (flops, bytes), got {type(out).__name__}"
                                + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""))
        flops, n_bytes = _ch08_number(out[0], f"{call}[0] (the FLOPs)"), _ch08_number(out[1], f"{call}[1] (the bytes)")
        e = _ch08_dtype_size(dtype)

        want = attention_flops(b, h, n_q, n_kv, d, causal, mode)
        if not math.isclose(flops, want, rel_tol=1e-9):
            full = attention_flops(b, h, n_q, n_kv, d, False, mode)
            fwd = attention_flops(b, h, n_q, n_kv, d, causal, "fwd")
            hints = [
                (causal, full, "that is the count WITHOUT the causal halving: causal attention is "
                               "credited half the work (x0.5), since about half of the (i, j) pairs are hidden"),
                (mode == "bwd", fwd, "that is the forward's count: the backward is credited 2.5x the "
                                     "forward (5 matrix products against 2)"),
                (mode == "bwd", fwd * 2, "the backward does 5 matrix products (S again, dV, dP, dQ, dK), "
                                         "2.5x the forward's 2, not 2x"),
                (mode == "bwd", fwd * 3.5, "that counts 7 products per tile pair, which is what flashattn's "
                                           "deterministic backward really does; the convention credits 5 "
                                           "(2.5x the forward) whatever the implementation"),
                (True, want / 2, "each multiply-add is 2 FLOPs: one product of (N_q x D) by (D x N_kv) "
                                 "costs 2 * N_q * N_kv * D"),
                (n_q != n_kv, want * n_q / n_kv, "use N_q * N_kv, not N_q squared"),
                (n_q != n_kv, want * n_kv / n_q, "use N_q * N_kv, not N_kv squared"),
                (b > 1, want / b, "multiply by the batch size too"),
                (h > 1, want / h, "multiply by the number of heads too"),
            ]
            hint = "; or else, ".join(dict.fromkeys(text for applies, value, text in hints
                                                    if applies and math.isclose(flops, value, rel_tol=1e-9)))
            raise ExerciseError(f"{call}: FLOPs {flops:.6g}, expected {want:.6g}"
                                + (f": {hint}" if hint else " (4 * B * H * N_q * N_kv * D, x0.5 if causal, "
                                   "x2.5 for the backward)"))

        want_b = _ch08_bytes(b, h, n_q, n_kv, d, mode, e)
        if n_bytes != want_b:
            bh = b * h
            hints = [
                (causal, want_b / 2, "the causal mask halves the FLOPs, not the bytes: every row of K and V "
                                     "is still read by some query, every row of Q and O still exists"),
                (causal, (want_b - 4 * bh * n_q) / 2 + 4 * bh * n_q,
                 "the causal mask halves the FLOPs, not the bytes: every row of K and V is still read"),
                (True, want_b - 4 * bh * n_q, "the LSE is missing: one float32 per query row, written by the "
                                              "forward and read by the backward"),
                (e != 4, want_b - 4 * bh * n_q + e * bh * n_q, "the LSE is float32 (4 bytes per row) "
                                                               "whatever the dtype of Q, K, V"),
                (e != 4, _ch08_bytes(b, h, n_q, n_kv, d, mode, 4), f"that assumes 4 bytes per element; {dtype} "
                                                                   f"has {e} (torch.empty((), dtype=dtype).element_size())"),
                (True, want_b * 8, "that is bits; count bytes"),
                (mode == "bwd", _ch08_bytes(b, h, n_q, n_kv, d, "fwd", e),
                 "that is the forward's traffic: the backward reads Q, K, V, O, dO and the LSE and writes "
                 "dQ, dK and dV"),
                (mode == "bwd", want_b + 4 * bh * n_q, "Delta is an intermediate of one implementation (it "
                                                       "could be computed on the fly); count only inputs and outputs"),
                (mode == "bwd", want_b + 8 * bh * n_q, "Delta is an intermediate of one implementation (it "
                                                       "could be computed on the fly); count only inputs and outputs"),
                (n_q != n_kv, _ch08_bytes(b, h, n_kv, n_q, d, mode, e), "N_q and N_kv are swapped: Q, O (and "
                                                                        "dQ, dO) have N_q rows, K and V N_kv"),
            ]
            hint = "; or else, ".join(dict.fromkeys(text for applies, value, text in hints
                                                    if applies and n_bytes == value))
            raise ExerciseError(f"{call}: bytes {n_bytes:,.0f}, expected {want_b:,}"
                                + (f": {hint}" if hint else
                                   " (count each tensor read or written once: e bytes per element, float32 LSE)"))
    passed(f"{name} gives the FLOPs and the minimal bytes on {len(cases)} settings (forward and backward, "
           "causal or not, N_q != N_kv, fp16/bf16/fp32, head dims 40 to 256)")


def _ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                    pad=True, accumulators=None, dkdv_resident_kv=True, kv_per_stage=2,
                    resident_tiles=None):
    """The two numbers flashattn.tuning.fits judges a configuration by: fp32 values per thread
    held in registers, and shared-memory bytes. The keywords reproduce known mistakes."""
    from .tuning import block_d

    bd = block_d(head_dim) if pad else head_dim
    resident, streamed = ((block_kv, block_q) if kernel == "bwd_dkdv" and dkdv_resident_kv
                          else (block_q, block_kv))
    acc, scores = accumulators or {"fwd": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (1, 2)}[kernel]
    values = (acc * resident * bd + scores * resident * streamed) / (num_warps * 32)
    if resident_tiles is None:
        resident_tiles = 1 if kernel == "fwd" else 2
    smem = (resident_tiles * resident + num_stages * kv_per_stage * streamed) * bd * element_size
    return values, smem


def _ch08_fits(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size):
    values, smem = _ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size)
    divides = kernel != "bwd_dkdv" or block_kv % block_q == 0
    return values <= _CH08_VALUES_PER_THREAD and smem <= _CH08_SMEM_PER_BLOCK and divides


def _ch08_resource_cases():
    """(kernel, BLOCK_Q, BLOCK_KV, head_dim, num_warps, num_stages, element_size): every candidate
    of flashattn.tuning (tensor-core and FMA lists) at several head dims and element sizes."""
    from .tuning import FMA_CONFIGS, GPU_CONFIGS

    cases = []
    for kernel in _CH08_KERNELS:
        configs = GPU_CONFIGS[kernel] + FMA_CONFIGS[kernel]
        for head_dim in (16, 40, 64, 80, 128, 192, 256):
            for element_size in (2, 4):
                for c in configs:
                    cases.append((kernel, c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_KV"], head_dim,
                                  c.num_warps, c.num_stages, element_size))
    return cases


def check_estimate_resources(estimate_resources):
    """Chapter 08: ``estimate_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages,
    element_size)`` must return ``(values_per_thread, smem_bytes)`` as flashattn.tuning.fits counts
    them, for kernel "fwd", "bwd_dkdv" or "bwd_dq"."""
    from . import tuning

    name = getattr(estimate_resources, "__name__", "estimate_resources")
    cases = _ch08_resource_cases()
    over_registers = over_smem = 0
    for kernel, bq, bkv, hd, warps, stages, e in cases:
        call = f"{name}({kernel!r}, {bq}, {bkv}, head_dim={hd}, num_warps={warps}, num_stages={stages}, element_size={e})"
        out = attempt(estimate_resources, kernel, bq, bkv, hd, warps, stages, e, name=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{call} should return a tuple (values_per_thread, smem_bytes), got "
                                f"{type(out).__name__}")
        values, smem = _ch08_number(out[0], f"{call}[0]"), _ch08_number(out[1], f"{call}[1]")
        want_v, want_s = _ch08_resources(kernel, bq, bkv, hd, warps, stages, e)
        # The reference must say what the package says (it is the package's rule, spelled out).
        config = _ch08_config(bq, bkv, warps, stages)
        assert _ch08_fits(kernel, bq, bkv, hd, warps, stages, e) == tuning.fits(kernel, config, tuning.block_d(hd), e), \
            "flashattn.tuning.fits has changed: update _ch08_resources"
        over_registers += want_v > _CH08_VALUES_PER_THREAD
        over_smem += want_s > _CH08_SMEM_PER_BLOCK
        mistake = dict(
            no_pad=(hd != tuning.block_d(hd), _ch08_resources(kernel, bq, bkv, hd, warps, stages, e, pad=False),
                    f"the tiles are BLOCK_D = {tuning.block_d(hd)} wide, not head_dim = {hd}: the kernels pad the "
                    "head dim to a power of two of at least 16 (flashattn.tuning.block_d)"),
            swapped=(kernel == "bwd_dkdv" and bq != bkv,
                     _ch08_resources(kernel, bq, bkv, hd, warps, stages, e, dkdv_resident_kv=False),
                     "in the dK/dV kernel the KEY tile is resident (BLOCK_KV rows stay) and query tiles "
                     "(BLOCK_Q rows) stream past it"),
            one_acc=(kernel != "fwd", _ch08_resources(kernel, bq, bkv, hd, warps, stages, e, accumulators=(1, 1)),
                     "dK/dV accumulates two tiles (dK and dV) and holds two score-shaped ones (S and dP); dQ "
                     "accumulates one (dQ) but also holds two score-shaped ones (S and dP)"),
        )
        for value, want, what, limit in ((values, want_v, "fp32 values per thread", "registers"),
                                         (smem, want_s, "shared-memory bytes", "shared memory")):
            index = 0 if limit == "registers" else 1
            if math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-9):
                continue
            hint = next((text for applies, wrong, text in mistake.values()
                         if applies and math.isclose(value, wrong[index], rel_tol=1e-9)
                         and not math.isclose(wrong[index], want, rel_tol=1e-9)), None)
            if hint is None and index == 0:
                hint = {want * 32: "that is per warp: divide by the threads, num_warps * 32",
                        want * warps * 32: "that is per block: divide by the threads, num_warps * 32",
                        want * 4: "count values (4-byte fp32 numbers), not bytes"}.get(value)
            if hint is None and index == 1:
                resident_tiles = 1 if kernel == "fwd" else 2
                wrong = {
                    _ch08_resources(kernel, bq, bkv, hd, warps, stages, e, kv_per_stage=1)[1]:
                        "each pipeline stage holds TWO streamed tiles (K and V in the forward and dQ kernels, "
                        "Q and dO in dK/dV)",
                    _ch08_resources(kernel, bq, bkv, hd, warps, stages, e, resident_tiles=0)[1]:
                        "the resident tile(s) live in shared memory too (Q in the forward; two in the backward)",
                    _ch08_resources(kernel, bq, bkv, hd, warps, stages, 4)[1]:
                        f"the tiles are stored in the input dtype, {e} bytes per element, not as float32",
                    _ch08_resources(kernel, bq, bkv, hd, warps, stages, e,
                                    resident_tiles=3 - resident_tiles if kernel != "fwd" else 2)[1]:
                        "the forward keeps one resident tile (Q), the backward kernels two (K and V; Q and dO)",
                    want * 8: "that is bits; count bytes",
                }
                wrong.pop(want, None)
                hint = wrong.get(value)
            raise ExerciseError(f"{call}: {what} {value:,.6g}, expected {want:,.6g}"
                                + (f": {hint}" if hint else f" (the {limit} rule of flashattn.tuning.fits)"))
    passed(f"{name} counts registers and shared memory like flashattn.tuning.fits on {len(cases)} cases "
           f"(3 kernels, head dims 16 to 256, 2- and 4-byte inputs; {over_registers} over the register "
           f"limit, {over_smem} over the shared-memory limit)")


def _ch08_config(block_q, block_kv, num_warps, num_stages):
    """A triton.Config with these tiles, as flashattn.tuning lists them."""
    import triton

    return triton.Config({"BLOCK_Q": block_q, "BLOCK_KV": block_kv}, num_warps=num_warps, num_stages=num_stages)


_CH08_BLOCKS = (16, 32, 64, 128, 256)
_CH08_WARPS = (4, 8)
_CH08_STAGES = (1, 2, 3, 4)


def _ch08_fitting(kernel, head_dim, element_size):
    """Every configuration of the exercise's grid that fits, as (BLOCK_Q, BLOCK_KV, warps, stages)."""
    return [(bq, bkv, w, s) for bq in _CH08_BLOCKS for bkv in _CH08_BLOCKS for w in _CH08_WARPS
            for s in _CH08_STAGES if _ch08_fits(kernel, bq, bkv, head_dim, w, s, element_size)]


def _ch08_why_not(kernel, bq, bkv, head_dim, warps, stages, e):
    """Which limit a configuration breaks, in words (None if it fits)."""
    from .tuning import block_d

    values, smem = _ch08_resources(kernel, bq, bkv, head_dim, warps, stages, e)
    reasons = []
    if values > _CH08_VALUES_PER_THREAD:
        reasons.append(f"registers: it holds {values:.0f} fp32 values per thread (accumulators and score tiles "
                       f"spread over {warps * 32} threads), more than ~{_CH08_VALUES_PER_THREAD} before the "
                       "compiler spills; use more warps or smaller tiles")
    if smem > _CH08_SMEM_PER_BLOCK:
        reasons.append(f"shared memory: resident tile(s) plus {stages} stage(s) of two streamed tiles, "
                       f"BLOCK_D = {block_d(head_dim)} wide at {e} bytes, make {smem:,.0f} bytes, more than the "
                       f"{_CH08_SMEM_PER_BLOCK:,} (227 KB) one block may use; use fewer stages or a smaller "
                       "streamed tile")
    if kernel == "bwd_dkdv" and bkv % bq:
        reasons.append("the dK/dV kernel steps through the queries from the diagonal: BLOCK_Q must divide BLOCK_KV")
    return "; and ".join(reasons) or None


def check_choose_config(choose_config):
    """Chapter 08: ``choose_config(kernel, head_dim, element_size)`` must return a dict with BLOCK_Q,
    BLOCK_KV (powers of two, 16 to 256), num_warps (4 or 8) and num_stages (1 to 4) that fits an
    H100/H200 by flashattn.tuning.fits and whose score tile holds at least 64 x 64 elements (or as
    many as any fitting configuration can, where 64 x 64 does not fit)."""
    from . import tuning

    name = getattr(choose_config, "__name__", "choose_config")
    chosen = {}
    for kernel in _CH08_KERNELS:
        for head_dim in (16, 64, 80, 128, 192, 256):
            for e in (2, 4):
                call = f"{name}({kernel!r}, head_dim={head_dim}, element_size={e})"
                config = attempt(choose_config, kernel, head_dim, e, name=name)
                if not isinstance(config, dict):
                    raise ExerciseError(f"{call} should return a dict like dict(BLOCK_Q=128, BLOCK_KV=64, "
                                        f"num_warps=8, num_stages=3), got {type(config).__name__}")
                missing = [k for k in ("BLOCK_Q", "BLOCK_KV", "num_warps", "num_stages") if k not in config]
                if missing:
                    raise ExerciseError(f"{call} returned {config}: the key(s) {missing} are missing")
                try:
                    bq, bkv, warps, stages = (int(config[k]) for k in ("BLOCK_Q", "BLOCK_KV", "num_warps", "num_stages"))
                except (TypeError, ValueError):
                    raise ExerciseError(f"{call} returned {config}: the values should be integers") from None
                if bq not in _CH08_BLOCKS or bkv not in _CH08_BLOCKS:
                    raise ExerciseError(f"{call} returned {config}: BLOCK_Q and BLOCK_KV must be powers of two "
                                        "from 16 (the smallest tile tl.dot takes) to 256")
                if warps not in _CH08_WARPS:
                    raise ExerciseError(f"{call} returned {config}: num_warps must be 4 or 8 (one or two "
                                        "warpgroups, what Hopper's wgmma instructions are issued by)")
                if stages not in _CH08_STAGES:
                    raise ExerciseError(f"{call} returned {config}: num_stages must be 1 to 4")
                problem = _ch08_why_not(kernel, bq, bkv, head_dim, warps, stages, e)
                if problem:
                    raise ExerciseError(f"{call} returned {config}, which does not fit: {problem}.")
                assert tuning.fits(kernel, _ch08_config(bq, bkv, warps, stages), tuning.block_d(head_dim), e)
                fitting = _ch08_fitting(kernel, head_dim, e)
                target = min(64 * 64, max(c[0] * c[1] for c in fitting))
                if bq * bkv < target:
                    example = max((c for c in fitting if c[0] * c[1] >= target),  # squarest, deepest pipeline
                                  key=lambda c: (-c[0] * c[1], -abs(c[0].bit_length() - c[1].bit_length()),
                                                 c[3], -c[2]))
                    raise ExerciseError(
                        f"{call} returned {config}: it fits, but its score tile has only {bq} x {bkv} = "
                        f"{bq * bkv} elements where {target} fit (for example BLOCK_Q={example[0]}, "
                        f"BLOCK_KV={example[1]}, num_warps={example[2]}, num_stages={example[3]}). Tiles this "
                        "small leave the tensor cores idle: on the H200, going from 16x16 to 64x64 tiles made "
                        "the bf16 forward 6x faster.")
                chosen[(kernel, head_dim, e)] = (bq, bkv, warps, stages)
    passed(f"{name} picks configurations that fit and are not wastefully small for 3 kernels, 6 head dims "
           "and 2- and 4-byte inputs")
    print("your choices for 16-bit inputs (BLOCK_Q x BLOCK_KV, warps, stages):")
    for kernel in _CH08_KERNELS:
        print(f"  {kernel:9}" + "  ".join(f"D={hd}: {c[0]}x{c[1]} w{c[2]} s{c[3]}" for hd in (64, 128, 256)
                                          for c in [chosen[(kernel, hd, 2)]]))
