"""Checker of chapter 14's kernel exercise: a softcap and a key-padding mask added to the learner's
three loops, the forward's (chapter 05) and the two backward ones (chapter 07), through one piece
``my_scores`` that all three call, and the mask's strides (``mask_strides``) on the host.

The loops run inside small kernels given here (``scores_fwd_kernel``, ``scores_dq_kernel``,
``scores_dkdv_kernel``): one program per (block, head, batch), the mask moved to its (batch, head)
with the learner's strides, the forward's two stages and chapter 07's query ranges. Q, K, V and dO
lie in memory each in its own way, and the loops read them as chapter 07's do, each through its own
strides; the last case is float16. The outputs are judged against float64 under the course's rule;
a wrong one is compared with what the likely mistakes give (:func:`score_model`) so that the message
names the mistake: the cap taken on the wrong score, the scale applied twice, the factor
1 - tanh**2 missing from dS in one backward loop, the mask inverted or read untransposed in the
dK/dV loop, a broadcast dim's stride not 0.
"""
import contextlib
import inspect
import io
import math
import re

import torch
import triton
import triton.language as tl

from ..notebook import pick
from ...gpu.runtime import DEVICE
from ...kernels.tiles import LN2, LOG2E, kv_stage_bounds, load_tile, store_tile
from ...testing.reference import causal_mask, modified_attention
from ...testing.rule import judge
from .ch07 import padded_view
from .ch14 import check_softcap_piece
from .common import (ExerciseError, attempt, close, helpers_of, is_stub, launch_learner_kernel,
                     not_implemented, passed)

FORBID = ("flashattn", "softmax", "sdpa")
GPU_TOL = 1e-2  # on a GPU, tl.dot multiplies float32 tiles in TF32 unless told otherwise


# --- The kernels around the learner's loops --------------------------------------------------------------

@triton.jit
def scores_fwd_kernel(Q, K, V, O, LSE, Mask,
                      stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
                      stride_mb, stride_mh, stride_mq, stride_mk, n_heads, n_q, n_kv, qk_scale, softcap,
                      INNER: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                      HAS_MASK: tl.constexpr):
    """The forward of chapter 05's Exercise 2 around the learner's loop ``INNER``, for (B, H, N, D)
    tensors, each with strides of its own, a head dim that is a power of two, and the mask moved to
    this program's (batch, head)."""
    q_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = batch.to(tl.int64), head.to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    LSE += (b * n_heads + h) * n_q
    Mask += b * stride_mb + h * stride_mh
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_tile(Q, offs_q, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, True, False)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_q, offs_d,
                          0, kv_full_end, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
                          BLOCK_KV, False, IS_CAUSAL, SOFTCAP, HAS_MASK)
    acc, m_i, l_i = INNER(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_q, offs_d,
                          kv_full_end, kv_end, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
                          BLOCK_KV, True, IS_CAUSAL, SOFTCAP, HAS_MASK)
    tl.store(LSE + offs_q, m_i + tl.log2(l_i), mask=offs_q < n_q)
    store_tile(O, acc / l_i[:, None], offs_q, offs_d, stride_on, stride_od, n_q, HEAD_DIM, False)


@triton.jit
def scores_dq_kernel(Q, K, V, dO, LSE, Delta, dQ, Mask,
                     stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
                     stride_dqb, stride_dqh, stride_dqn, stride_dqd, stride_mb, stride_mh, stride_mq, stride_mk,
                     n_heads, n_q, n_kv, scale, qk_scale, softcap, INNER: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr):
    """Chapter 07's dQ kernel around the learner's loop ``INNER``, every tensor with its own strides."""
    q_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = batch.to(tl.int64), head.to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    dO += b * stride_dob + h * stride_doh
    dQ += b * stride_dqb + h * stride_dqh
    LSE += (b * n_heads + h) * n_q
    Delta += (b * n_heads + h) * n_q
    Mask += b * stride_mb + h * stride_mh
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_tile(Q, offs_q, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, True, False)
    do = load_tile(dO, offs_q, offs_d, stride_don, stride_dod, n_q, HEAD_DIM, True, False)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_q, offs_d,
               0, kv_full_end, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
               HEAD_DIM, BLOCK_KV, False, IS_CAUSAL, SOFTCAP, HAS_MASK)
    dq = INNER(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_q, offs_d,
               kv_full_end, kv_end, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
               HEAD_DIM, BLOCK_KV, True, IS_CAUSAL, SOFTCAP, HAS_MASK)
    store_tile(dQ, dq * scale, offs_q, offs_d, stride_dqn, stride_dqd, n_q, HEAD_DIM, False)


@triton.jit
def scores_dkdv_kernel(Q, K, V, dO, LSE, Delta, dK, dV, Mask,
                       stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
                       stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                       stride_mb, stride_mh, stride_mq, stride_mk, n_heads, n_q, n_kv, scale, qk_scale, softcap,
                       INNER: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr):
    """Chapter 07's dK/dV kernel around the learner's loop ``INNER``, every tensor with its own
    strides: the diagonal (masked, causal only), the whole query blocks, the ragged last one."""
    kv_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = batch.to(tl.int64), head.to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    dO += b * stride_dob + h * stride_doh
    dK += b * stride_dkb + h * stride_dkh
    dV += b * stride_dvb + h * stride_dvh
    LSE += (b * n_heads + h) * n_q
    Delta += (b * n_heads + h) * n_q
    Mask += b * stride_mb + h * stride_mh
    kv_start = kv_block * BLOCK_KV
    offs_kv = kv_start + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, HEAD_DIM)
    k = load_tile(K, offs_kv, offs_d, stride_kn, stride_kd, n_kv, HEAD_DIM, True, False)
    v = load_tile(V, offs_kv, offs_d, stride_vn, stride_vd, n_kv, HEAD_DIM, True, False)
    dk = tl.zeros([BLOCK_KV, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:  # queries before kv_start see none of these keys
        q_lo = kv_start
        q_full_lo = tl.minimum(kv_start + BLOCK_KV, n_q)
    else:
        q_lo = 0
        q_full_lo = 0
    q_full_hi = q_full_lo + tl.maximum(n_q - q_full_lo, 0) // BLOCK_Q * BLOCK_Q
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_lo, q_full_lo, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
                   HEAD_DIM, BLOCK_Q, True, IS_CAUSAL, SOFTCAP, HAS_MASK)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_full_lo, q_full_hi, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
                   HEAD_DIM, BLOCK_Q, False, IS_CAUSAL, SOFTCAP, HAS_MASK)
    dk, dv = INNER(dk, dv, k, v, Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod, offs_kv, offs_d,
                   q_full_hi, n_q, n_q, n_kv, qk_scale, softcap, Mask, stride_mq, stride_mk,
                   HEAD_DIM, BLOCK_Q, True, IS_CAUSAL, SOFTCAP, HAS_MASK)
    store_tile(dK, dk * scale, offs_kv, offs_d, stride_dkn, stride_dkd, n_kv, HEAD_DIM, False)
    store_tile(dV, dv, offs_kv, offs_d, stride_dvn, stride_dvd, n_kv, HEAD_DIM, False)


# --- The mask's strides ----------------------------------------------------------------------------------

def _mask_cases():
    """Bool masks of the shapes attn_mask takes, each in a larger buffer (so a wrong stride reads other
    entries, never memory outside): (mask, the strides the kernels must get)."""
    g = torch.Generator().manual_seed(140)
    cases = []
    for shape in [(2, 1, 1, 7), (1, 3, 5, 7), (2, 3, 5, 7), (2, 1, 5, 7), (1, 1, 1, 7), (3, 2, 1, 1)]:
        buffer = torch.rand(*(n + 2 for n in shape), generator=g) > 0.5
        mask = buffer[tuple(slice(0, n) for n in shape)]
        cases.append((mask, tuple(0 if n == 1 else st for n, st in zip(mask.shape, mask.stride()))))
    return cases


def check_mask_strides(mask_strides):
    """``mask_strides(mask)``: the four strides of a bool mask (B or 1, H or 1, N_q or 1, N_kv), 0 on
    every dim of size 1 (read by every batch row, head or query)."""
    for mask, want in _mask_cases():
        got = attempt(mask_strides, mask, name="mask_strides", forbid=("flashattn",))
        try:
            got = tuple(int(x) for x in got)
        except (TypeError, ValueError):
            raise ExerciseError(f"mask_strides should return four ints, got {type(got).__name__}") from None
        where = f"mask_strides of a mask of shape {tuple(mask.shape)} and strides {mask.stride()} returned {got}"
        if got == want:
            continue
        if got == tuple(mask.stride()):
            raise ExerciseError(f"{where}: a dim of size 1 is broadcast, so the kernels read it with stride 0 (every "
                                "head, or every query, reads the same entries); its own stride would step to the "
                                "next batch row's entries, or past the mask")
        if got == tuple(0 if st == 1 else st for st in mask.stride()):
            raise ExerciseError(f"{where}: the SIZE says whether a dim is broadcast (size 1: stride 0), not the "
                                "stride; the key dim's stride is 1 and stays 1")
        raise ExerciseError(f"{where}, expected {want}: the tensor's own stride on each dim of size > 1, and 0 "
                            "on each dim of size 1")


# --- What the loops compute, with or without the likely mistakes -------------------------------------------

BASE2 = ("the cap was applied to the base-2 score s * qk_scale: the formula caps the scaled score scale * s = "
         "s * qk_scale * ln 2, and the capped score then goes to base 2 (times log2 e)")

#: The mistakes :func:`score_model` knows: {field: {value: what it means}}; the right value is None.
SLIPS = {
    "score": {
        "base2": BASE2,
        "base2, as is": BASE2,
        "raw": "the cap was applied to the raw score q . k: the formula caps the scaled score scale * s "
               "(= s * qk_scale * ln 2)",
        "natural": "the capped score went to exp2 as it is, in natural units: multiply it by log2(e) for "
                   "the base-2 softmax",
        "twice": "qk_scale was applied twice: my_scores returns scores already scaled and in base 2, so the "
                 "loop takes max(s) and exp2(s - m) without another qk_scale",
    },
    "dcap": {
        "none": "the softcap's factor is missing from dS: dS = P * (dP - Delta) * (1 - tanh**2), the dcap "
                "my_scores returns (the chain rule through the cap)",
        "dp": "the softcap's factor went on dP: it multiplies the whole dS, P * (dP - Delta) * dcap, since the "
              "cap sits before the softmax",
    },
    "mask": {
        "inverted": "the mask is inverted: True (nonzero) marks a key that is seen, False a key to hide",
        "untransposed": "the mask was read with keys and queries swapped: in the dK/dV loop's transposed tile "
                        "the keys run down the rows and the queries along the columns, and the mask is read "
                        "at (query, key): my_scores(sT, queries[None, :], offs_kv[:, None], ...)",
    },
}


def score_model(q, k, v, do, is_causal, cap, keep, slips=None):
    """(out, lse, dq, dk, dv) in float64 of loops making ``slips`` ({field: value} of :data:`SLIPS`):
    the forward as the softmax of its scores, the backward rebuilt from the right forward's LSE and
    Delta, as the kernels get them. ``keep``: a bool mask broadcastable to the scores, or None."""
    slips = slips or {}
    q, k, v, do = (t.detach().cpu().double() for t in (q, k, v, do))
    keep = keep.cpu() if keep is not None else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    raw = q @ k.transpose(-2, -1)
    x = raw * scale
    dcap = torch.ones_like(x)
    if cap:
        t = torch.tanh(x / cap)
        s2 = cap * t * LOG2E
        dcap = 1 - t * t
        what = slips.get("score")
        if what == "base2":
            s2 = cap * torch.tanh(x * LOG2E / cap) * LOG2E
        elif what == "base2, as is":
            s2 = cap * torch.tanh(x * LOG2E / cap)
        elif what == "raw":
            s2 = cap * torch.tanh(raw / cap) * LOG2E
        elif what == "natural":
            s2 = cap * t
    else:
        s2 = x * LOG2E
    if slips.get("score") == "twice":
        s2 = s2 * scale * LOG2E
    seen = torch.ones(x.shape[-2:], dtype=torch.bool)
    if is_causal:
        seen = causal_mask(*x.shape[-2:])
    fwd_seen = seen & (keep if slips.get("mask") != "inverted" else ~keep) if keep is not None else seen
    s2f = s2.masked_fill(~fwd_seen, float("-inf"))
    lse_f = torch.logsumexp(s2f * LN2, -1)
    out = torch.exp(s2f * LN2 - lse_f[..., None]) @ v
    # the backward, from the right forward's LSE and Delta
    right_out, right_lse = modified_attention(q, k, v, attn_mask=keep, is_causal=is_causal, softcap=cap)
    lse2, delta = right_lse * LOG2E, (right_out * do).sum(-1)
    bwd_seen = fwd_seen
    if keep is not None and slips.get("mask") == "untransposed":
        # a key-padding mask read at (key, query): pair (i, j) keeps query i's entry, where j < N_q
        n_q, n_kv = x.shape[-2:]
        tokens = keep[..., 0, :n_q, None] & (torch.arange(n_kv) < n_q)
        bwd_seen = seen & tokens
    p = torch.exp2(s2.masked_fill(~bwd_seen, float("-inf")) - lse2[..., None])
    dp = do @ v.transpose(-2, -1)
    if slips.get("dcap") == "none":
        ds = p * (dp - delta[..., None])
    elif slips.get("dcap") == "dp":
        ds = p * (dp * dcap - delta[..., None])
    else:
        ds = p * (dp - delta[..., None]) * dcap
    return out, lse_f, scale * ds @ k, scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do


# --- Running the learner's loops -------------------------------------------------------------------------

def run_loops(my_fwd_tiles, my_dq_tiles, my_dkdv_tiles, strides, q, k, v, do, is_causal, cap, keep,
              fwd_blocks=(16, 16), dq_blocks=(16, 16), dkdv_blocks=(16, 32)):
    """(out, lse, dq, dk, dv) of the three loops in the kernels above, on (B, H, N, D) tensors of
    any strides (float32 or float16), with the softcap ``cap`` (0: none) and the bool mask ``keep``
    (None: none) read through ``strides`` (the learner's ``mask_strides``); the backward gets the
    float64 LSE and Delta. lse is the natural log-sum-exp."""
    batch, heads, n_q, d = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    if keep is None:
        mask, strides = torch.zeros(1, dtype=torch.uint8, device=DEVICE), (0, 0, 0, 0)
    else:
        mask = keep.view(torch.uint8)              # the same bytes, strides kept
    flags = dict(HEAD_DIM=d, IS_CAUSAL=bool(is_causal), SOFTCAP=bool(cap), HAS_MASK=keep is not None)
    common = (*strides, heads, n_q, n_kv)

    def empty(like):
        return torch.full(like.shape, float("nan"), dtype=like.dtype, device=DEVICE)

    o, lse2 = empty(q), torch.full((batch, heads, n_q), float("nan"), device=DEVICE)
    bq, bkv = fwd_blocks
    launch_learner_kernel(scores_fwd_kernel, (triton.cdiv(n_q, bq), heads, batch),
                          (q, k, v, o, lse2, mask, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *common,
                           scale * LOG2E, float(cap), my_fwd_tiles), dict(BLOCK_Q=bq, BLOCK_KV=bkv, **flags),
                          "my_fwd_tiles", my_fwd_tiles, forbid=FORBID)
    right_out, right_lse = modified_attention(*(t.cpu().double() for t in (q, k, v)),
                                              attn_mask=None if keep is None else keep.cpu(),
                                              is_causal=is_causal, softcap=cap)
    lse_in = (right_lse * LOG2E).float().contiguous().to(DEVICE)
    delta = (right_out * do.cpu().double()).sum(-1).float().contiguous().to(DEVICE)
    dq = empty(q)
    bq, bkv = dq_blocks
    launch_learner_kernel(scores_dq_kernel, (triton.cdiv(n_q, bq), heads, batch),
                          (q, k, v, do, lse_in, delta, dq, mask, *q.stride(), *k.stride(), *v.stride(),
                           *do.stride(), *dq.stride(), *common, scale, scale * LOG2E, float(cap), my_dq_tiles),
                          dict(BLOCK_Q=bq, BLOCK_KV=bkv, **flags), "my_dq_tiles", my_dq_tiles, forbid=FORBID)
    dk, dv = empty(k), empty(v)
    bq, bkv = dkdv_blocks
    launch_learner_kernel(scores_dkdv_kernel, (triton.cdiv(n_kv, bkv), heads, batch),
                          (q, k, v, do, lse_in, delta, dk, dv, mask, *q.stride(), *k.stride(), *v.stride(),
                           *do.stride(), *dk.stride(), *dv.stride(), *common, scale, scale * LOG2E, float(cap),
                           my_dkdv_tiles), dict(BLOCK_Q=bq, BLOCK_KV=bkv, **flags),
                          "my_dkdv_tiles", my_dkdv_tiles, forbid=FORBID)
    return o, lse2.double() * LN2, dq, dk, dv


#: (B, H, N_q, N_kv, is_causal, softcap, the mask, dtype): the softcap alone first (so that a mistake
#: of the mask shows alone), then a key-padding mask (the lengths of its sequences) alone, then both,
#: causal; then a mask of one row per (head, query), (1, H, N_q, N_kv), which only strides read right;
#: last both in float16, where the loops multiply 16-bit tiles (dS and P^T converted first).
CASES = [(1, 2, 40, 40, False, 2.0, None, torch.float32),
         (1, 2, 37, 45, True, 5.0, None, torch.float32),
         (2, 2, 33, 40, False, 0.0, [29, 13], torch.float32),
         (2, 2, 40, 40, True, 3.0, [40, 22], torch.float32),
         (2, 2, 24, 30, False, 0.0, "per head and query", torch.float32),
         (2, 2, 37, 45, True, 5.0, [45, 20], torch.float16)]
#: How Q, K, V and dO lie in memory (layouts of ch07.padded_view, NaN around each): no column stride
#: is 1, and the two tensors a loop streams (K and V; Q and dO) have strides unlike each other's,
#: so that a loop must read each through its own.
LAYOUTS = dict(q="strided_d", k="transposed", v="strided_d", do="transposed")


def _mask(spec, batch, heads, n_q, n_kv, g):
    """The bool mask of a case on DEVICE, as a view into a larger buffer (so that a wrong stride reads
    other entries, never memory outside it), or None."""
    if spec is None:
        return None
    if spec == "per head and query":
        buffer = (torch.rand(3, heads + 2, n_q + 3, n_kv + 5, generator=g) > 0.4).to(DEVICE)
        keep = buffer[:1, :heads, :n_q, :n_kv]
        keep[..., 0] = True                                  # every query sees key 0
        return keep
    buffer = torch.ones(batch + 2, 3, 3, n_kv + 5, dtype=torch.bool, device=DEVICE)
    keep = buffer[:batch, :1, :1, :n_kv]                     # a key-padding mask, (B, 1, 1, N_kv)
    keep.copy_((torch.arange(n_kv) < torch.tensor(spec)[:, None])[:, None, None, :])
    return keep


NAMES = ("out", "lse", "dq", "dk", "dv")
LOOP_OF = {"out": "my_fwd_tiles", "lse": "my_fwd_tiles", "dq": "my_dq_tiles", "dk": "my_dkdv_tiles",
           "dv": "my_dkdv_tiles"}


def _passes(got, ref64, pt, names, upstream, dtype):
    if pick(cpu=False, gpu=True):
        return all(close(got[n], ref64[n], GPU_TOL * max(1.0, ref64[n].abs().max().item()), GPU_TOL) for n in names)
    return all(c.ok for c in judge({n: got[n].cpu() for n in names}, {n: ref64[n] for n in names},
                                   {n: pt[n] for n in names}, dtype, upstream))


def _reference(q, k, v, do, is_causal, cap, keep):
    """The formula's (out, lse, dq, dk, dv) in float64 and as plain PyTorch in q's dtype."""
    results = []
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = modified_attention(*leaves, attn_mask=None if keep is None else keep.cpu(),
                                      is_causal=is_causal, softcap=cap)
        results.append(dict(zip(NAMES, (out.detach(), lse.detach(),
                                        *torch.autograd.grad(out, leaves, do.cpu().to(dtype))))))
    return results


def _name_slip(got, names, q, k, v, do, is_causal, cap, keep, fields):
    """The description of the one mistake of ``fields`` whose model matches every output in ``names``
    (and differs from the right answer there), or None."""
    right = dict(zip(NAMES, score_model(q, k, v, do, is_causal, cap, keep)))
    for field in fields:
        for value, hint in SLIPS[field].items():
            model = dict(zip(NAMES, score_model(q, k, v, do, is_causal, cap, keep, {field: value})))
            if all(close(model[n], right[n], 1e-3, 1e-3) for n in names):
                continue
            if all(close(got[n], model[n], 1e-3, 1e-3) for n in names):
                return hint
    return None


def check_score_loops(my_fwd_tiles, my_dq_tiles, my_dkdv_tiles, mask_strides):
    """Chapter 14: the learner's three loops with a softcap (``SOFTCAP``, ``softcap``) and a bool
    attn_mask (``HAS_MASK``, ``Mask`` moved to the (batch, head), ``stride_mq``, ``stride_mk``), through
    the piece ``my_scores`` they share; and ``mask_strides`` for the host. Forward and backward
    against float64 under the course's rule, on the cases of :data:`CASES`."""
    own = {"mask_strides": mask_strides, **helpers_of(my_fwd_tiles, "my_scores"), "my_fwd_tiles": my_fwd_tiles,
           "my_dq_tiles": my_dq_tiles, "my_dkdv_tiles": my_dkdv_tiles}
    for name, fn in own.items():
        if fn is None:
            raise ExerciseError(f"{name} is not defined: run the cell that defines it first")
        if is_stub(fn):
            raise not_implemented(name)
    check_mask_strides(mask_strides)
    piece = helpers_of(my_fwd_tiles, "my_softcap")["my_softcap"]
    scores = getattr(own["my_scores"], "fn", own["my_scores"])
    if piece is not None and re.search(r"\bmy_softcap\b", inspect.getsource(scores)):
        if is_stub(piece):
            raise ExerciseError("my_softcap (Exercise 1) is not implemented yet: my_scores calls it, so write it "
                                "first.")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check_softcap_piece(piece)
        except ExerciseError as error:
            raise ExerciseError(f"{error} (Exercise 1's piece, which my_scores calls.)") from None
    for n, (batch, heads, n_q, n_kv, causal, cap, spec, dtype) in enumerate(CASES):
        g = torch.Generator().manual_seed(1400 + n)
        q, do = (torch.randn(batch, heads, n_q, 16, generator=g) for _ in range(2))
        k, v = (torch.randn(batch, heads, n_kv, 16, generator=g) for _ in range(2))
        q, k, v, do = (padded_view(t.shape, LAYOUTS[name], dtype, t)
                       for t, name in zip((q, k, v, do), ("q", "k", "v", "do")))
        keep = _mask(spec, batch, heads, n_q, n_kv, g)
        strides = None
        if keep is not None:
            strides = tuple(int(x) for x in attempt(mask_strides, keep, name="mask_strides", forbid=("flashattn",)))
        what = (f"B={batch}, H={heads}, N_q={n_q}, N_kv={n_kv}, is_causal={causal}, softcap={cap}, "
                + ("no mask" if spec is None else f"a mask {tuple(keep.shape)}" if isinstance(spec, str)
                   else f"a key-padding mask of lengths {spec}") + ("" if dtype == torch.float32 else ", float16"))
        try:
            got = dict(zip(NAMES, run_loops(my_fwd_tiles, my_dq_tiles, my_dkdv_tiles, strides, q, k, v, do, causal,
                                            cap, keep)))
        except ExerciseError as error:
            if "same dtype" not in str(error):
                raise
            raise ExerciseError(f"{str(error).split()[0]} failed on float16 inputs ({what}): tl.dot got a float32 "
                                "tile and a float16 one. Convert the float32 tile to the other's dtype before the "
                                "product, as chapter 07's loops do (dS to K's for dQ; P^T to dO's for dV, dS^T to "
                                "Q's for dK): 16-bit tiles multiply on the tensor cores.") from None
        ref64, pt = _reference(q, k, v, do, causal, cap, keep)
        upstream = do.abs().max().item()
        for names, fields in ((("out", "lse"), ("score", "mask")), (("dq",), ("dcap", "score", "mask")),
                              (("dk", "dv"), ("dcap", "score", "mask"))):
            if _passes(got, ref64, pt, names, upstream, dtype):
                continue
            loop = LOOP_OF[names[0]]
            outputs = " and ".join({"out": "O", "lse": "the LSE", "dq": "dQ", "dk": "dK", "dv": "dV"}[x] for x in names)
            alike = dict(zip(NAMES, run_loops(my_fwd_tiles, my_dq_tiles, my_dkdv_tiles, strides,
                                              *(t.contiguous() for t in (q, k, v, do)), causal, cap, keep)))
            if _passes(alike, ref64, pt, names, upstream, dtype):
                raise ExerciseError(f"{outputs} of {loop} {'is' if len(names) == 1 else 'are'} wrong ({what}), where "
                                    "Q, K, V and dO each have strides of their own, and right on contiguous copies of "
                                    "them: read each tensor through its own strides, as chapter 07's loops do (K "
                                    "with stride_kn and stride_kd, V with stride_vn and stride_vd; Q with stride_qn "
                                    "and stride_qd, dO with stride_don and stride_dod).")
            if any(torch.isnan(got[x]).any() for x in names):
                raise ExerciseError(f"{outputs} of {loop} {'has' if len(names) == 1 else 'have'} NaN ({what}): a "
                                    "row whose scores are all -inf in its first tile gives exp2(-inf - (-inf)). Every "
                                    "query here sees key 0: is the mask inverted? A nonzero entry marks a key that "
                                    "is seen, and -inf goes where the entry is 0")
            said = _name_slip(got, names, q, k, v, do, causal, cap, keep, fields) if dtype == torch.float32 else None
            if said:
                raise ExerciseError(f"{outputs} of {loop} {'is' if len(names) == 1 else 'are'} wrong ({what}): {said}.")
            dq_ok = _passes(got, ref64, pt, ("dq",), upstream, dtype)
            if keep is not None and names[0] == "dk" and cap == 0.0 and dq_ok:
                raise ExerciseError(f"dK and dV of my_dkdv_tiles are wrong ({what}), dQ right: the tile is transposed "
                                    "there, keys along the rows and queries along the columns; call my_scores with "
                                    "the query indices as rows and the key indices as cols: (queries[None, :], "
                                    "offs_kv[:, None])")
            if isinstance(spec, str):   # the key-padding masks passed: their rows are all the same
                raise ExerciseError(f"{outputs} of {loop} {'is' if len(names) == 1 else 'are'} wrong ({what}), "
                                    "though right with key-padding masks, whose rows are all the same: my_scores "
                                    "reads the entry (query, key) at Mask + rows * stride_mq + cols * stride_mk")
            raise ExerciseError(f"{outputs} of {loop} {'is' if len(names) == 1 else 'are'} wrong ({what}): the "
                                "loop rebuilds P from my_scores' base-2 scores, the same in all three loops, "
                                + ("and puts dcap on dS." if names[0] != "out" else "then chapter 05's update."))
    passed(f"my_fwd_tiles, my_dq_tiles and my_dkdv_tiles pass the rule against float64 in all {len(CASES)} "
           "cases (a softcap, a key-padding mask read through mask_strides, both, causal and not, a mask per head "
           "and query, float16; Q, K, V and dO each with strides of its own)")
