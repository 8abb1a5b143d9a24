"""Merging partial attention states: chapter 01's merge of softmax states, between kernel calls.

A kernel call over some of a row's keys returns that part's output ``O_a`` (already divided by its
own sum) and its base-2 log-sum-exp ``LSE_a``. Two parts of the same row merge exactly:

    LSE = log2(2**LSE_a + 2**LSE_b)
    O   = 2**(LSE_a - LSE) * O_a + 2**(LSE_b - LSE) * O_b

computed from ``M = max(LSE_a, LSE_b)`` so that nothing overflows. A part without keys (a row the
causal mask hides from a whole block) has ``LSE = -inf`` and weighs 0; a row with no keys at all
stays ``O = 0``, ``LSE = -inf``.
"""
import torch


def merge_partials(o_a, lse_a, o_b, lse_b):
    """The merged state ``(o, lse)`` of two partial states of the same rows: ``o_*`` of shape
    (..., N, D), ``lse_*`` of shape (..., N), base 2. ``o`` comes back in float32, ``lse`` in the
    wider of the two LSE dtypes."""
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    lse_a, lse_b = lse_a.to(lse_dtype), lse_b.to(lse_dtype)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both parts empty: any finite M
    w_a, w_b = torch.exp2(lse_a - m), torch.exp2(lse_b - m)      # <= 1; 0 for an empty part
    total = w_a + w_b
    lse = m + torch.log2(total)                                   # log2(0) = -inf: no keys at all
    safe = torch.where(total > 0, total, torch.ones_like(total))
    share_a = (w_a / safe).to(torch.float32)[..., None]            # 2**(LSE_a - LSE)
    share_b = (w_b / safe).to(torch.float32)[..., None]
    return share_a * o_a.to(torch.float32) + share_b * o_b.to(torch.float32), lse
