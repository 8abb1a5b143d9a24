"""Checkers of chapters 00-02: naive causal attention and the longest context whose S and P fit
(00), the online softmax and merging softmax states (01), the instructions each form of the
exponential compiles to (a prediction, checked against the PTX for sm_90) and the LSE from a
base-2 state (02).

Each is named check_<exercise> and draws its own inputs (several shapes, including awkward ones) so
that a hard-coded answer cannot pass; a wrong answer that matches a known mistake is named.
"""
import functools
import math
import re

import torch
import triton
import triton.language as tl

from ...kernels.tiles import LN2, LOG2E
from .common import ExerciseError, attempt, close, expect_close, passed


def _result(fn, *args, name, count=None, **rules):
    """Call the learner's function (``rules``: what it may not call, see ``attempt``); check the
    kind of result before any comparison."""
    out = attempt(fn, *args, name=name, **rules)
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
    if close(got, want, atol, rtol):
        return
    for hint, wrong in mistakes:
        if wrong is not None and not close(wrong, want, atol, rtol) and close(got, wrong, atol, rtol):
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
        got = _result(fn, q.clone(), k.clone(), v.clone(), scale, name=name, forbid=("sdpa", "flashattn"))
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


def check_max_context(fn):
    """Chapter 00: ``fn(batch, heads, dtype, memory_bytes)`` must return the largest N (an int) for
    which S and P of self-attention, two (batch, heads, N, N) tensors of ``dtype``, fit together in
    ``memory_bytes`` bytes (they may fill it exactly)."""
    name = getattr(fn, "__name__", "max_context")
    gb, gib = 10 ** 9, 2 ** 30
    cases = [(1, 32, torch.float16, 141 * gb),     # one sequence, 32 heads, an H200's 141 GB
             (1, 32, torch.float16, 128 * gib),    # S and P at N = 32768 fill it exactly
             (8, 16, torch.bfloat16, 80 * gb), (2, 8, torch.float32, 24 * gb), (3, 5, torch.float64, 10 ** 7),
             (1, 1, torch.float32, 2 * 4 * 17 * 17 + 7), (4, 12, torch.float16, 2 * gib)]
    # The slips, each as what it returns for (batch, heads, bytes per element, memory): a wrong answer
    # is named by the slip that gives all of its results (one case alone can fit two slips).
    slips = [
        (lambda b, h, e, m: math.isqrt(m // (b * h * e)), "that counts ONE N x N matrix: S and P are two"),
        (lambda b, h, e, m: math.isqrt(m // (2 * e)), "S and P exist for every sequence of the batch and every "
                                                      "head: multiply by both"),
        (lambda b, h, e, m: math.isqrt(m // (2 * b * h * 4)), "that assumes 4 bytes per element; element_size() "
                                                              "gives each dtype's own"),
        (lambda b, h, e, m: math.isqrt(m // (2 * b * h)), "that counts 1 byte per element; element_size() gives "
                                                          "each dtype's own"),
        (lambda b, h, e, m: math.isqrt(m // (2 * b * h * e * 8)), "that counts bits; element_size() is in bytes"),
        (lambda b, h, e, m: m // (2 * b * h * e), "S is N x N: its bytes grow as N squared, so N is a square "
                                                  "root (math.isqrt)"),
    ]
    results = []
    for b, h, dtype, memory in cases:
        got = attempt(fn, b, h, dtype, memory, name=name, forbid=("flashattn",))
        call = f"{name}({b}, {h}, {dtype}, {memory:,})"
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise ExerciseError(f"{call} returned {type(got).__name__}; return a number of positions "
                                "(an int)") from None
        if value != int(value):
            raise ExerciseError(f"{call} returned {value}: a context holds a whole number of positions, "
                                "the largest N that fits (round down)")
        size = torch.empty((), dtype=dtype).element_size()
        results.append((call, int(value), (b, h, size, memory)))
    def longest(b, h, e, m):  # the largest N with 2 * b * h * N * N * e <= m
        return math.isqrt(m // (2 * b * h * e))

    wrong = [(call, n, args) for call, n, args in results if n != longest(*args)]
    if not wrong:
        passed(f"{name} finds the longest context on {len(cases)} cases (float16, bfloat16, float32, float64; "
               "from an H200's 141 GB down to a few hundred bytes, one filled exactly)")
        return
    call, n, (b, h, size, memory) = wrong[0]
    want = longest(b, h, size, memory)
    hint = next((text for slip, text in slips if all(slip(*args) == got for _, got, args in results)), None)
    if hint is None and n > want:
        hint = (f"at N = {n:,} S and P need {2 * b * h * n * n * size:,} bytes, more than the {memory:,} given: "
                "the largest N that fits is the square root rounded down")
    if hint is None:
        hint = (f"N = {n + 1:,} fits too (S and P need {2 * b * h * (n + 1) ** 2 * size:,} bytes of the "
                f"{memory:,}): return the largest N that fits; S and P may fill the memory exactly")
    raise ExerciseError(f"{call} returned {n:,}, expected {want:,}: {hint}")


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
            m, l = _result(fn, m_a.clone(), l_a.clone(), m_b.clone(), l_b.clone(), name=name, count=2,
                           forbid=("flashattn",))
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
        got = _result(fn, s.clone(), block, name=name, forbid=("softmax", "sdpa", "flashattn"), row_block=block)
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
        _diagnose(f"the probability row of {name}", got, want, mistakes, atol=1e-10, rtol=1e-8, where=where)
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
        got = _result(fn, s.clone(), v.clone(), block, name=name, forbid=("softmax", "sdpa", "flashattn"),
                      row_block=block)
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
        got = _result(fn, m2.clone(), l.clone(), name=name, forbid=("softmax", "flashattn"))
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


@triton.jit
def exp_forms(X, Y, n, c, m, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """Y = one form of the exponential of X: ``tl.exp(x)``, ``tl.exp2(x)``, or the attention
    kernels' ``tl.exp2(x * c - m)`` (the scale and the row max folded into the argument)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    if FORM == "exp":
        y = tl.exp(x)
    elif FORM == "exp2":
        y = tl.exp2(x)
    else:
        y = tl.exp2(x * c - m)
    tl.store(Y + offs, y, mask=offs < n)


#: The three forms of :func:`exp_forms` (its FORM -> what it computes), and the float32 instructions
#: a prediction counts per element: ex2.approx, mul, fma, and add or sub together.
EXP_FORMS = {"exp": "tl.exp(x)", "exp2": "tl.exp2(x)", "fma": "tl.exp2(x * c - m)"}
INSTRUCTIONS = {"ex2": r"\bex2\.approx(\.ftz)?\.f32", "mul": r"\bmul(\.rn)?(\.ftz)?\.f32",
                "fma": r"\bfma\.rn(\.ftz)?\.f32", "add": r"\b(add|sub)(\.rn)?(\.ftz)?\.f32"}
EXP_BLOCK, EXP_WARPS = 256, 4  # 256 elements over 128 threads: two elements per thread

#: Why each form compiles to what it does (the PTX for sm_90 of Triton 3.x), per instruction.
_EX2 = "every form computes one exponential per element, and the hardware's only one is ex2.approx.f32 (base 2)"
_WHY = {
    ("tl.exp(x)", "mul"): "the hardware has no e^x, so tl.exp(x) is computed as 2^(x * log2 e): one mul.f32 by "
                          "log2 e (the float32 constant 0f3FB8AA3B) before each ex2",
    ("tl.exp(x)", "fma"): "tl.exp(x) only multiplies x by log2 e before the ex2: nothing is added",
    ("tl.exp(x)", "add"): "tl.exp(x) only multiplies x by log2 e before the ex2: nothing is added",
    ("tl.exp2(x)", "mul"): "tl.exp2(x) is the hardware's own exponential: ex2.approx.f32 and nothing else",
    ("tl.exp2(x)", "fma"): "tl.exp2(x) is the hardware's own exponential: ex2.approx.f32 and nothing else",
    ("tl.exp2(x)", "add"): "tl.exp2(x) is the hardware's own exponential: ex2.approx.f32 and nothing else",
    ("tl.exp2(x * c - m)", "fma"): "x * c - m is one fma.rn.f32 per element: the compiler fuses the multiply "
                                   "and the subtraction into a fused multiply-add (Triton's enable_fp_fusion, "
                                   "on for this check), which adds -m",
    ("tl.exp2(x * c - m)", "mul"): "the fma.rn.f32 multiplies x by c itself: no separate mul.f32",
    ("tl.exp2(x * c - m)", "add"): "the subtraction happens inside the fma.rn.f32, which adds -m (negated "
                                   "once per thread, not once per element)",
}
#: The instructions in the order a wrong prediction is explained: what decides each form first.
_ORDER = {"tl.exp(x)": ("mul", "ex2", "fma", "add"), "tl.exp2(x)": ("ex2", "mul", "fma", "add"),
          "tl.exp2(x * c - m)": ("fma", "mul", "add", "ex2")}


#: The counts per element that the explanations above describe.
EXPECTED_COUNTS = {"tl.exp(x)": dict(ex2=1, mul=1, fma=0, add=0), "tl.exp2(x)": dict(ex2=1, mul=0, fma=0, add=0),
                   "tl.exp2(x * c - m)": dict(ex2=1, mul=0, fma=1, add=0)}


@functools.lru_cache(maxsize=1)
def exp_forms_ptx():
    """{form: its PTX for sm_90}, the three forms of :func:`exp_forms` compiled once per process
    (no GPU needed: a child process tells Triton one is there). With FP fusion on, whatever
    Triton's default: Triton 3.9 fuses by default, 3.10 will not, and the fma form's answer is
    the fusion."""
    from ...measure.compiled import ptx_of_many

    texts = ptx_of_many([dict(kernel=exp_forms, pointers=dict(X="fp32", Y="fp32"), floats=("c", "m"),
                              constexprs=dict(FORM=form, BLOCK=EXP_BLOCK), num_warps=EXP_WARPS, arch=90,
                              enable_fp_fusion=True)
                         for form in EXP_FORMS])
    return dict(zip(EXP_FORMS.values(), texts))


def instruction_counts(ptx):
    """{form: {instruction: how many per element}} in the PTX of :func:`exp_forms_ptx`."""
    per_thread = EXP_BLOCK // (32 * EXP_WARPS)
    return {form: {kind: len(re.findall(pattern, text)) / per_thread for kind, pattern in INSTRUCTIONS.items()}
            for form, text in ptx.items()}


def check_ptx_prediction(fn):
    """Chapter 02: ``fn()`` returns a prediction, {form: {"ex2": n, "mul": n, "fma": n, "add": n}},
    of the float32 instructions per element of each form of :func:`exp_forms` on sm_90. The check
    compiles the forms and explains each number the compiler does otherwise."""
    name = getattr(fn, "__name__", "predicted_instructions")
    got = attempt(fn, name=name, forbid=("flashattn",))
    forms = list(EXP_FORMS.values())
    if not isinstance(got, dict) or set(got) != set(forms):
        raise ExerciseError(f"{name}() should return a dict with one entry per form, {forms}; got "
                            + (f"the keys {sorted(got)}" if isinstance(got, dict) else type(got).__name__))
    for form in forms:
        row = got[form]
        if not isinstance(row, dict) or set(row) != set(INSTRUCTIONS) or \
                not all(isinstance(v, (int, float)) for v in row.values()):
            raise ExerciseError(f"{name}()[{form!r}] should be a dict of numbers with the keys "
                                f"{sorted(INSTRUCTIONS)}, got {row!r}")
    counts = instruction_counts(exp_forms_ptx())
    for form in forms:
        for kind in _ORDER[form]:
            measured, predicted = counts[form][kind], got[form][kind]
            if predicted == measured:
                continue
            why = _EX2 if kind == "ex2" else _WHY.get((form, kind), "")
            unit = {"add": "add.f32 or sub.f32", "ex2": "ex2.approx.f32"}.get(kind, f"{kind}.f32")
            explained = why and measured == EXPECTED_COUNTS[form][kind]
            raise ExerciseError(f"{name}: for {form} you predicted {predicted:g} {unit} per element, the PTX "
                                f"for sm_90 has {measured:g}" + (f": {why}" if explained else ""))
    passed(f"{name} predicts the float32 instructions of all three forms, as the compiler emits them for sm_90")


def check_block_alphas(fn):
    """Chapter 01: ``block_alphas(block_maxima) -> list of floats``: the correction factor alpha of
    each block of a streamed row, from the blocks' own maxima alone (natural base): 0 at the first
    block (the empty state's M is -inf), then e^(M_old - M_new) with M the running max."""
    import math

    name = "block_alphas"
    cases = [[1.5, 3.0, 2.0, 2.5, 4.5], [0.0], [2.0, 2.0, 2.0], [5.0, 1.0, 6.0, -3.0], [-1.0, -0.5, -2.0, 0.25]]
    for maxima in cases:
        call = f"{name}({maxima})"
        got = attempt(fn, list(maxima), name=name, forbid=("flashattn",))
        try:
            got = [float(a) for a in got]
        except Exception:
            raise ExerciseError(f"{call} should return a list of floats, one alpha per block, got {got!r}") from None
        if len(got) != len(maxima):
            raise ExerciseError(f"{call} returned {len(got)} values; expected one alpha per block, {len(maxima)}")
        running = [max(maxima[:b + 1]) for b in range(len(maxima))]
        want = [0.0] + [math.exp(running[b - 1] - running[b]) for b in range(1, len(maxima))]
        if all(abs(g - w) <= 1e-9 for g, w in zip(got, want)):
            continue
        if abs(got[0] - 1.0) <= 1e-9 and all(abs(g - w) <= 1e-9 for g, w in zip(got[1:], want[1:])):
            why = ("the first block's alpha is e^(M - M_new) with the empty state's M = -inf, so it is 0: "
                   "there is nothing before it to rescale (with 1 the result is the same only because L = 0)")
        elif all(abs(g - 1 / w) <= 1e-9 * max(1, 1 / w) for g, w in zip(got[1:], want[1:]) if w > 0) \
                and any(w < 1 for w in want[1:]):
            why = "alpha = e^(M_old - M_new) is at most 1; yours has the exponent's sign flipped"
        elif all(abs(g - math.exp(maxima[b - 1] - maxima[b])) <= 1e-9 for b, g in enumerate(got) if b > 0):
            why = ("alpha compares the running max M (the max of every block so far), not the previous block's "
                   "own max: when a block's max is lower than M, M stays and alpha = 1")
        else:
            b = next(b for b, (g, w) in enumerate(zip(got, want)) if abs(g - w) > 1e-9)
            why = (f"block {b}: the running max goes from {running[b - 1] if b else float('-inf')} to {running[b]}, "
                   f"so alpha = {want[b]:.6g}, not {got[b]:.6g}")
        raise ExerciseError(f"{call} is wrong: {why}.")
    passed(f"{name} gives every block's alpha in all {len(cases)} cases (M rising, staying, one block)")
