"""Checkers of chapter 11: merging the partial states that the splits of split-KV decoding write
(what ``flashattn.decode``'s merge kernel does), in PyTorch.
"""
import math

import torch

from .common import ExerciseError, attempt, close, expect_close, passed

LN2 = math.log(2.0)


def _partials(g, lead, sizes, head_dim, spread, shift):
    """Partial states of rows of shape ``lead`` whose keys are cut into splits of ``sizes`` keys
    (0: a split without keys): ``O_s`` (each divided by its own sum) and ``LSE_s`` (base 2, -inf
    for an empty split), float32, as the split kernel writes them. Each split's scores get their
    own offset, so that the splits' LSE differ, and ``shift`` moves them all."""
    o_parts = torch.zeros(*lead, len(sizes), head_dim, dtype=torch.float64)
    lse_parts = torch.full((*lead, len(sizes)), float("-inf"), dtype=torch.float64)
    for split, size in enumerate(sizes):
        if size == 0:
            continue
        s = torch.randn(*lead, size, generator=g, dtype=torch.float64) * spread
        s = s + shift + 4 * torch.randn((), generator=g, dtype=torch.float64)
        v = torch.randn(*lead, size, head_dim, generator=g, dtype=torch.float64)
        lse_parts[..., split] = torch.logsumexp(s, -1) / LN2
        o_parts[..., split, :] = (torch.softmax(s, -1)[..., None] * v).sum(-2)
    return o_parts.float(), lse_parts.float()


def _merge64(o_parts, lse_parts, variant=None):
    """The merge in float64 (the reference), or with a known mistake (``variant``) so that a wrong
    answer can be named."""
    o_parts, lse_parts = o_parts.double(), lse_parts.double()
    m = lse_parts.max(-1, keepdim=True).values
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    exp = torch.exp if variant == "natural exp" else torch.exp2
    w = exp(lse_parts - m_safe)
    l = w.sum(-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    o = (w[..., None] * o_parts).sum(-2) / l_safe
    if variant == "no weights":
        o = o_parts.mean(-2)
    elif variant == "divided twice":
        o = o / l_safe
    log = torch.log if variant in ("natural exp", "natural log") else torch.log2
    lse = torch.where(l > 0, m_safe + log(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    if variant == "lse without M":
        lse = torch.where(l > 0, torch.log2(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    return o, lse


HINTS = {
    "no weights": "O is the plain mean of the O_s. Each O_s is the average over its own split's keys "
                  "only, so it must be weighed by that split's share of the whole sum, "
                  "2**(LSE_s - LSE): a split whose scores are larger counts for more.",
    "divided twice": "O looks divided by the sum twice. The weights 2**(LSE_s - M) / L already sum to 1 "
                     "and each O_s is already divided by its own sum: divide sum_s w_s O_s by "
                     "L = sum_s w_s once, and nothing else.",
    "natural exp": "the weights use e**x. The LSE_s are in base 2 (the kernel works with exp2): weigh "
                   "with 2**(LSE_s - M) (torch.exp2) and take log2 of the sum.",
    "natural log": "LSE is in natural log. The inputs are base 2 and so is the result: "
                   "LSE = M + log2(sum_s 2**(LSE_s - M)) (torch.log2, not torch.log).",
    "lse without M": "LSE is missing the max: the sum was taken relative to M = max_s LSE_s, so "
                     "LSE = M + log2(sum_s 2**(LSE_s - M)).",
}


def _diagnose(what, got, want, o_parts, lse_parts, index, atol, rtol, where):
    """Raise an ExerciseError naming the mistake ``got`` matches (output ``index``: 0 for O, 1
    for LSE), or saying where and by how much it is wrong."""
    if close(got, want, atol, rtol):
        return
    for variant, hint in HINTS.items():
        wrong = _merge64(o_parts, lse_parts, variant)[index]
        if not close(wrong, want, atol, rtol) and close(got, wrong, atol, rtol):
            raise ExerciseError(f"{what} is wrong{where}: {hint}")
    try:
        expect_close(what, got, want, atol=atol, rtol=rtol)
    except ExerciseError as error:
        raise ExerciseError(f"{error}{where}") from None


def check_merge_split_partials(merge_split_partials):
    """Chapter 11: ``merge_split_partials(o_parts, lse_parts)`` must merge the partial states of
    the splits of each row, ``o_parts`` (..., S, D) and ``lse_parts`` (..., S) in base 2, into the
    row's ``(o, lse)``: o (..., D) = sum_s 2**(LSE_s - LSE) O_s, lse (...) = log2 sum_s 2**LSE_s,
    and o = 0, lse = -inf for a row whose splits are all empty."""
    name = getattr(merge_split_partials, "__name__", "merge_split_partials")
    g = torch.Generator().manual_seed(10)
    stages = [  # (what, leading dims, split sizes, head dim, spread of scores, shift)
        ("two splits", (5,), (7, 9), 8, 1.0, 0.0),
        ("one split", (3,), (13,), 4, 2.0, 0.0),
        ("four ragged splits, (B, H_q, N_q) rows", (2, 3, 2), (16, 16, 16, 5), 16, 3.0, 0.0),
        ("splits whose scores differ a lot", (4,), (6, 6, 6), 8, 20.0, 0.0),
        ("an empty split between two (LSE_s = -inf, O_s = 0)", (4,), (8, 0, 5), 8, 1.0, 0.0),
        ("large scores (LSE_s above 200: 2**200 overflows float32)", (3,), (5, 9, 4), 8, 1.0, 150.0),
        ("very negative scores (LSE_s below -200: 2**-200 is 0 in float32)", (3,), (5, 9, 4), 8, 1.0, -150.0),
        ("every split empty (a sequence of length 0)", (3,), (0, 0, 0), 8, 1.0, 0.0),
    ]
    for stage, lead, sizes, head_dim, spread, shift in stages:
        o_parts, lse_parts = _partials(g, lead, sizes, head_dim, spread, shift)
        want_o, want_lse = _merge64(o_parts, lse_parts)
        where = f" (case: {stage}; o_parts of shape {tuple(o_parts.shape)})"
        out = attempt(merge_split_partials, o_parts.clone(), lse_parts.clone(), name=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{name} should return a tuple (o, lse), got {type(out).__name__}"
                                + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""))
        o, lse = (torch.as_tensor(x) for x in out)
        if tuple(o.shape) != tuple(want_o.shape) or tuple(lse.shape) != tuple(want_lse.shape):
            raise ExerciseError(f"{name} returned o of shape {tuple(o.shape)} and lse of shape "
                                f"{tuple(lse.shape)}; expected {tuple(want_o.shape)} and "
                                f"{tuple(want_lse.shape)} (the split dim S is merged away){where}")
        bad = torch.isnan(o.double()).any() or torch.isnan(lse.double()).any()
        if bad and sum(sizes) == 0:
            raise ExerciseError(
                f"{name} returns NaN{where}. With every LSE_s = -inf, M = -inf and LSE_s - M = "
                "-inf - (-inf) = NaN; and L = 0 makes sum_s w_s O_s / L = 0/0. Use a finite stand-in "
                "for M when it is -inf (e.g. torch.where(M == -inf, 0, M)) and divide by 1 where "
                "L = 0, so that the row gets o = 0 and lse = -inf, the empty sum.")
        finite = torch.isfinite(torch.cat([o.double().flatten(), lse.double().flatten()]))
        if abs(shift) > 100 and not finite.all():
            raise ExerciseError(
                f"{name} returns inf or NaN{where}. 2**LSE_s overflows float32 above 2**128 and is 0 "
                "below 2**-149: subtract the largest LSE_s first, M = max_s LSE_s, and weigh with "
                "2**(LSE_s - M), which is at most 1 (chapter 01's merge, in base 2).")
        _diagnose(f"{name}: o", o, want_o, o_parts, lse_parts, 0, 1e-5, 1e-4, where)
        _diagnose(f"{name}: lse", lse, want_lse, o_parts, lse_parts, 1, 1e-5, 1e-5, where)
    passed(f"{name} merges split partial states in {len(stages)} cases: one to four splits, empty splits, "
           "rows without keys, and LSE_s far beyond float32's range of 2**x")
