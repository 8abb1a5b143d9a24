"""The FlashAttention backward kernels and their launcher.

Chapter 06 derives, for one (batch, head), with ``S = scale * Q K^T``, ``P = softmax(S)``,
``O = P V`` and the upstream gradient ``dO``:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta)        Delta_i = sum_d dO_id O_id
    dQ = scale * dS K                     dK = scale * dS^T Q

Nothing of size N_q x N_kv is stored: each kernel rebuilds the tiles of P it needs from Q, K and the
log-sum-exp saved by the forward pass, ``P = 2**(S * log2(e) - LSE2)``. Three kernels run in turn:

1. ``attn_bwd_preprocess``: Delta, one number per query row.
2. ``attn_bwd_dkdv``: one program per key block keeps K and V on chip and loops over the query
   blocks that see them, accumulating dK and dV (both need the same column of P).
3. ``attn_bwd_dq``: one program per query block keeps Q on chip and loops over the key blocks,
   accumulating dQ, like the forward pass.

Each output tile is written by exactly one program, in a fixed order, so the result is bit-identical
from run to run (no atomics). Under grouped-query attention the dK/dV program of a K/V head loops
over the query heads that read it and sums their shares itself; under a sliding window or with
packed sequences the kernels take the forward's ranges and tables (see flashattn.kernels.forward). Every
program stores its tile, zeros included, so keys that no query sees get dK = dV = 0.
The score modifications and dropout of the forward (see flashattn.kernels.forward) are rebuilt
the same way, dropout's mask from the seed and each pair's index, and a softcap multiplies dS by
its derivative ``1 - tanh**2``. With an attn_mask both kernels walk its tile lists, as the forward
does: the dQ kernel per query block, the dK/dV kernel per key block (flashattn.kernels.masks).
FlashAttention-2 instead lets the dK/dV program add its share of dQ into memory with atomic adds
(5 tile matmuls per tile pair instead of 7); docs/performance.md compares the two.

Q, K, dQ and dK have Q's head dim (``HEAD_DIM``, ``BLOCK_D``); V, O, dO, dV, and so the sums of
Delta and of ``dP = dO V^T``, have V's (``HEAD_DIM_V``, ``BLOCK_DV``), which may differ.

Where did the ln 2 of base 2 go? The kernels rebuild ``P = 2**(s * scale * log2(e) - LSE2)`` from the
raw score ``s = q.k``, so the chain rule gives ``dL/ds = ln(2) * scale * log2(e) * P * (dP - Delta)``:
the ln 2 from the derivative of ``2**x`` cancels the log2(e) folded into the exponent. The loops
compute ``dS = P * (dP - Delta)`` with no constant at all, and dQ and dK are multiplied by
``scale`` once, at the end.
"""
import torch
import triton
import triton.language as tl

from ..gpu import launcher
from ..gpu.configs import block_d, dkdv_steps_fit, dot_precision, head_dims, tile_block_d
from ..gpu.runtime import kernel_dtype
from .tiles import (dot, dot_acc, dropout_keep, kv_stage_bounds, kv_window_bounds, load_tile, modified_scores,
                    q_window_bounds, qk_scale, score_mod_setup, sequence_of_program, store_tile)
from .mods import NO_MODS
from .traversal import window_masking


@triton.jit(do_not_specialize=["n_heads", "n_q"])  # one binary for every length
def attn_bwd_preprocess(O, dO, Delta,
                         stride_ob, stride_oh, stride_on, stride_od,
                         stride_dob, stride_doh, stride_don, stride_dod,
                         n_heads, n_q,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Delta_i = sum_d dO_id * O_id for BLOCK_Q query rows, in fp32."""
    q_block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    O += batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    dO += batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    Delta += (batch.to(tl.int64) * n_heads + head) * n_q
    offs_q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(O, offs_q, offs_d, stride_on, stride_od, n_q, HEAD_DIM, True, HEAD_DIM < BLOCK_D)
    do = load_tile(dO, offs_q, offs_d, stride_don, stride_dod, n_q, HEAD_DIM, True, HEAD_DIM < BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + offs_q, delta, mask=offs_q < n_q)


@triton.jit
def dkdv_inner(dk, dv, k, v,
                Q, dO, LSE, Delta, stride_qn, stride_qd, stride_don, stride_dod,
                offs_kv, offs_d, offs_dv, q_lo, q_hi, n_q, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_Q: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WINDOW: tl.constexpr = False, EMPTY_ROWS: tl.constexpr = False, win_left=0, win_right=0,
                n_kv=0, shift=0, softcap=0.0, slope=0.0, Mask=None, stride_mq=0, stride_mk=0,
                seed=0, p_drop=0.0, drop_row0=0, drop_col0=0, kv_start=0, Tiles=None,
                SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = 0, LISTED: tl.constexpr = False,
                BLOCK_KV: tl.constexpr = 16):
    """Accumulate into dK and dV the query blocks ``[q_lo, q_hi)``.

    Everything here is transposed (keys along rows, queries along columns) because the key block
    is the one that stays: ``sT = K Q^T`` is S^T, and so on. The score modifications and dropout
    are the forward's (see forward.fwd_inner), rebuilt from the same ids: dV takes the dropped,
    rescaled P, dP the same mask, and the softcap's ``1 - tanh**2`` multiplies dS. LISTED walks
    the query blocks an attn_mask's tile list names (see forward.fwd_inner), ``kv_start`` being
    the key block's first key."""
    if LISTED:
        tile_next = tl.load(Tiles + q_lo // BLOCK_Q, mask=q_lo < q_hi, other=0)
    for q_start in range(q_lo, q_hi, BLOCK_Q):
        if LISTED:
            listed = q_start // BLOCK_Q + 1
            q_start = tile_next * BLOCK_Q
            tile_next = tl.load(Tiles + listed, mask=listed * BLOCK_Q < q_hi, other=0)
        q_start = tl.multiple_of(q_start, BLOCK_Q)
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        q = load_tile(Q, offs_q, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, MASKED, HEAD_DIM < BLOCK_D)
        do = load_tile(dO, offs_q, offs_dv, stride_don, stride_dod, n_q, HEAD_DIM_V, MASKED,
                       HEAD_DIM_V < BLOCK_DV)
        if MASKED:
            lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
            delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
        else:
            lse = tl.load(LSE + offs_q)
            delta = tl.load(Delta + offs_q)
        if EMPTY_ROWS:  # a row that saw no key has LSE -inf: 2**(-inf - +inf) = 0, not NaN
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
        sT = dot(k, tl.trans(q), DOT_PRECISION)   # S^T / scale
        if SOFTCAP or ALIBI or MASK_KIND != 0:  # scores already in base 2, scale applied
            sT, dcapT = modified_scores(sT, offs_q[None, :], offs_kv[:, None], n_q, n_kv, qk_scale, softcap,
                                        slope, shift, Mask, stride_mq, stride_mk, SOFTCAP, ALIBI, MASK_KIND)
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if MASKED:  # hidden pairs get a score of -inf, hence a probability of exactly 0
            visible = offs_q[None, :] < n_q
            if IS_CAUSAL:
                visible = visible & (offs_q[None, :] >= offs_kv[:, None])
            if WINDOW:
                visible = visible & (offs_kv[:, None] >= offs_q[None, :] - win_left) \
                    & (offs_kv[:, None] <= offs_q[None, :] + win_right)
            sT = tl.where(visible, sT, float("-inf"))
        if LSE.dtype.element_ty == tl.float64:  # the LSE to more than float32's precision
            lse_hi = lse.to(tl.float32)
            # (a row that saw no key has an infinite LSE and no low part: inf - inf would be NaN)
            finite = tl.abs(lse_hi) < float("inf")
            lse_lo = (tl.where(finite, lse, 0.0) - tl.where(finite, lse_hi, 0.0).to(tl.float64)).to(tl.float32)
            pT = tl.exp2(sT * s_scale - lse_hi[None, :] - lse_lo[None, :])
        else:
            pT = tl.exp2(sT * s_scale - lse[None, :])                # P^T, rebuilt from the LSE
        pT_kept = pT
        if DROPOUT:  # O = (P * keep / (1 - p)) V: the same factor on dV's P and on dP
            keepT = dropout_keep(seed, p_drop, drop_row0 + offs_q[None, :], tl.arange(0, BLOCK_KV)[:, None],
                                 drop_col0 + kv_start, BLOCK_KV, DROPOUT)
            pT_kept = tl.where(keepT, pT * (1.0 / (1.0 - p_drop)), 0.0)
        dv = dot_acc(pT_kept.to(do.dtype), do, dv, DOT_PRECISION)               # dV += P^T dO
        dpT = dot(v, tl.trans(do), DOT_PRECISION)            # dP^T = V dO^T
        if DROPOUT:
            dpT = tl.where(keepT, dpT * (1.0 / (1.0 - p_drop)), 0.0)
        dsT = pT * (dpT - delta[None, :])                                       # dS^T (unscaled)
        if SOFTCAP:  # d softcap(x) / dx = 1 - tanh**2
            dsT = dsT * dcapT
        dk = dot_acc(dsT.to(q.dtype), q, dk, DOT_PRECISION)                     # dK += dS^T Q
    return dk, dv


@triton.jit(do_not_specialize=["n_heads", "n_q", "n_kv", "win_left", "win_right", "seed"])  # one binary for every length
def attn_bwd_dkdv(Q, K, V, dO, LSE, Delta, dK, dV,
                   stride_qb, stride_qh, stride_qn, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_don, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   n_heads, n_q, n_kv, scale, qk_scale,
                   n_group, win_left, win_right, Programs, CuSeqQ, CuSeqK,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   WINDOW: tl.constexpr = False, VARLEN: tl.constexpr = False,
                   softcap=0.0, Slopes=None, stride_sb=0, stride_sh=0,
                   Mask=None, stride_mb=0, stride_mh=0, stride_mq=0, stride_mk=0, seed=0, p_drop=0.0,
                   Lists=None, stride_lb=0, stride_lh=0, stride_lr=0,
                   SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                   DROPOUT: tl.constexpr = 0, BOTTOM_RIGHT: tl.constexpr = False):
    # Grid: (key blocks, K/V heads, batch). Under grouped-query attention K/V head ``kv_head`` is
    # read by the n_group query heads kv_head * n_group + g: this program sums their shares of
    # dK and dV itself, in a fixed order (no atomics, no copy of K and V per query head).
    # Packed sequences (VARLEN): axis 0 walks the table ``Programs`` of (sequence, key block).
    kv_block, kv_head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    K += batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V += batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    dK += batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    dV += batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    Q += batch.to(tl.int64) * stride_qb
    dO += batch.to(tl.int64) * stride_dob
    LSE += batch.to(tl.int64) * n_heads * n_q
    Delta += batch.to(tl.int64) * n_heads * n_q
    n_rows = n_q  # the LSE's row length: all sequences' queries under VARLEN
    q_offset = 0
    drop_col0 = 0
    if VARLEN:  # move to this program's sequence; from here on n_q and n_kv are its lengths
        kv_block, q_offset, n_q, kv_offset, n_kv = sequence_of_program(Programs, CuSeqQ, CuSeqK,
                                                                       kv_block)
        K += kv_offset * stride_kn
        V += kv_offset * stride_vn
        dK += kv_offset * stride_dkn
        dV += kv_offset * stride_dvn
        Q += q_offset * stride_qn
        dO += q_offset * stride_don
        LSE += q_offset
        Delta += q_offset
        drop_col0 = kv_offset
    shift, win_left, win_right, no_slope = score_mod_setup(n_q, n_kv, win_left, win_right, batch, kv_head,
                                                    Programs, Slopes, stride_sb, stride_sh,
                                                    False, VARLEN, BOTTOM_RIGHT)

    kv_start = kv_block * BLOCK_KV
    offs_kv = kv_start + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)    # Q and K's head dim (dK's)
    offs_dv = tl.arange(0, BLOCK_DV)  # V and dO's, which may differ (dV's)
    k = load_tile(K, offs_kv, offs_d, stride_kn, stride_kd, n_kv, HEAD_DIM, True, HEAD_DIM < BLOCK_D)
    v = load_tile(V, offs_kv, offs_dv, stride_vn, stride_vd, n_kv, HEAD_DIM_V, True, HEAD_DIM_V < BLOCK_DV)
    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_DV], dtype=tl.float32)

    # Which queries see this key block (flashattn.kernels.traversal.q_ranges is the same in Python):
    # [q_lo, q_full_lo) cross the diagonal, [q_full_lo, q_full_hi) are whole unmasked blocks and
    # [q_full_hi, q_hi) is the ragged end. Queries before q_lo see none of these keys. Under a
    # window (traversal.q_window_ranges) both ends are masked and the queries past q_hi skipped.
    if WINDOW:
        q_lo, q_full_lo, q_full_hi, q_hi = q_window_bounds(kv_start, n_q, win_left, win_right,
                                                           BLOCK_Q, BLOCK_KV)
    else:
        if IS_CAUSAL:
            q_lo = kv_start
            q_full_lo = kv_start + BLOCK_KV  # BLOCK_Q divides BLOCK_KV (checked by the launcher)
        else:
            q_lo = 0
            q_full_lo = 0
        q_full_hi = q_full_lo + tl.maximum(n_q - q_full_lo, 0) // BLOCK_Q * BLOCK_Q  # empty past n_q
        q_hi = n_q
    for g in range(0, n_group):  # the query heads that read this K/V head
        head = kv_head * n_group + g
        Q_h = Q + head.to(tl.int64) * stride_qh
        dO_h = dO + head.to(tl.int64) * stride_doh
        LSE_h = LSE + head.to(tl.int64) * n_rows
        Delta_h = Delta + head.to(tl.int64) * n_rows
        # the slope is the query head's (the shift and bounds were set above, once for all heads)
        head_shift, head_left, head_right, slope = score_mod_setup(n_q, n_kv, 0, 0, batch, head, Programs, Slopes,
                                                                   stride_sb, stride_sh, ALIBI, VARLEN, False)
        drop_row0 = (batch.to(tl.int64) * n_heads + head) * n_rows + q_offset
        if MASK_KIND != 0:
            # attn_mask's tile lists for this key block and query head (see attn_fwd): the query
            # blocks that need no mask, then those that need it
            Mask_h = Mask + batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
            Tiles = Lists + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + kv_block * stride_lr
            n_full = tl.load(Tiles)
            n_listed = n_full + tl.load(Tiles + 1)
            dk, dv = dkdv_inner(dk, dv, k, v, Q_h, dO_h, LSE_h, Delta_h, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_kv, offs_d, offs_dv, 0, n_full * BLOCK_Q, n_q, qk_scale,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_Q, False, IS_CAUSAL, DOT_PRECISION,
                                 WINDOW, True, win_left, win_right, n_kv=n_kv, shift=shift, softcap=softcap,
                                 slope=slope, seed=seed, p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0,
                                 kv_start=kv_start, Tiles=Tiles + 2, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                 LISTED=True, BLOCK_KV=BLOCK_KV)
            dk, dv = dkdv_inner(dk, dv, k, v, Q_h, dO_h, LSE_h, Delta_h, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_kv, offs_d, offs_dv, n_full * BLOCK_Q,
                                 n_listed * BLOCK_Q, n_q, qk_scale,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_Q, True, IS_CAUSAL, DOT_PRECISION,
                                 WINDOW, True, win_left, win_right, n_kv=n_kv, shift=shift, softcap=softcap,
                                 slope=slope, Mask=Mask_h, stride_mq=stride_mq, stride_mk=stride_mk, seed=seed,
                                 p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0, kv_start=kv_start,
                                 Tiles=Tiles + 2, SOFTCAP=SOFTCAP, ALIBI=ALIBI, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
                                 LISTED=True, BLOCK_KV=BLOCK_KV)
        else:
            dk, dv = dkdv_inner(dk, dv, k, v, Q_h, dO_h, LSE_h, Delta_h, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_kv, offs_d, offs_dv, q_lo, tl.minimum(q_full_lo, n_q),
                                 n_q, qk_scale, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_Q, True, IS_CAUSAL,
                                 DOT_PRECISION, WINDOW, WINDOW or VARLEN, win_left, win_right,
                                 n_kv=n_kv, shift=shift, softcap=softcap, slope=slope, seed=seed, p_drop=p_drop,
                                 drop_row0=drop_row0, drop_col0=drop_col0, kv_start=kv_start,
                                 SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT, BLOCK_KV=BLOCK_KV)
            dk, dv = dkdv_inner(dk, dv, k, v, Q_h, dO_h, LSE_h, Delta_h, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_kv, offs_d, offs_dv, q_full_lo, q_full_hi, n_q, qk_scale,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_Q, False, IS_CAUSAL, DOT_PRECISION,
                                 WINDOW, WINDOW or VARLEN, win_left, win_right,
                                 n_kv=n_kv, shift=shift, softcap=softcap, slope=slope, seed=seed, p_drop=p_drop,
                                 drop_row0=drop_row0, drop_col0=drop_col0, kv_start=kv_start,
                                 SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT, BLOCK_KV=BLOCK_KV)
            dk, dv = dkdv_inner(dk, dv, k, v, Q_h, dO_h, LSE_h, Delta_h, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_kv, offs_d, offs_dv, q_full_hi, q_hi, n_q, qk_scale,
                                 HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_Q, True, IS_CAUSAL, DOT_PRECISION,
                                 WINDOW, WINDOW or VARLEN, win_left, win_right,
                                 n_kv=n_kv, shift=shift, softcap=softcap, slope=slope, seed=seed, p_drop=p_drop,
                                 drop_row0=drop_row0, drop_col0=drop_col0, kv_start=kv_start,
                                 SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT, BLOCK_KV=BLOCK_KV)

    # Every program stores its whole tile, zeros included: keys no query sees get dK = dV = 0.
    dk *= scale  # S = scale * Q K^T, so dK carries the scale once
    store_tile(dK, dk, offs_kv, offs_d, stride_dkn, stride_dkd, n_kv, HEAD_DIM, HEAD_DIM < BLOCK_D)
    store_tile(dV, dv, offs_kv, offs_dv, stride_dvn, stride_dvd, n_kv, HEAD_DIM_V, HEAD_DIM_V < BLOCK_DV)


@triton.jit
def dq_inner(dq, q, do, lse, delta,
              K, V, stride_kn, stride_kd, stride_vn, stride_vd,
              offs_q, offs_d, offs_dv, kv_lo, kv_hi, n_kv, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_KV: tl.constexpr,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              WINDOW: tl.constexpr = False, win_left=0, win_right=0,
              n_q=0, shift=0, softcap=0.0, slope=0.0, Mask=None, stride_mq=0, stride_mk=0,
              seed=0, p_drop=0.0, drop_row0=0, drop_col0=0, Tiles=None,
              SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
              MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = 0, LISTED: tl.constexpr = False):
    """Accumulate into dQ the key blocks ``[kv_lo, kv_hi)`` (modifications, dropout and LISTED as
    in :func:`dkdv_inner`)."""
    if LISTED:
        tile_next = tl.load(Tiles + kv_lo // BLOCK_KV, mask=kv_lo < kv_hi, other=0)
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        if LISTED:
            listed = kv_start // BLOCK_KV + 1
            kv_start = tile_next * BLOCK_KV
            tile_next = tl.load(Tiles + listed, mask=listed * BLOCK_KV < kv_hi, other=0)
        kv_start = tl.multiple_of(kv_start, BLOCK_KV)
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        k = load_tile(K, offs_kv, offs_d, stride_kn, stride_kd, n_kv, HEAD_DIM, MASKED, HEAD_DIM < BLOCK_D)
        v = load_tile(V, offs_kv, offs_dv, stride_vn, stride_vd, n_kv, HEAD_DIM_V, MASKED,
                      HEAD_DIM_V < BLOCK_DV)
        s = dot(q, tl.trans(k), DOT_PRECISION)    # S / scale
        if SOFTCAP or ALIBI or MASK_KIND != 0:  # scores already in base 2, scale applied
            s, dcap = modified_scores(s, offs_q[:, None], offs_kv[None, :], n_q, n_kv, qk_scale, softcap,
                                      slope, shift, Mask, stride_mq, stride_mk, SOFTCAP, ALIBI, MASK_KIND)
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if MASKED:
            visible = offs_kv[None, :] < n_kv
            if IS_CAUSAL:
                visible = visible & (offs_q[:, None] >= offs_kv[None, :])
            if WINDOW:
                visible = visible & (offs_kv[None, :] >= offs_q[:, None] - win_left) \
                    & (offs_kv[None, :] <= offs_q[:, None] + win_right)
            s = tl.where(visible, s, float("-inf"))
        p = tl.exp2(s * s_scale - lse[:, None])                       # P, rebuilt from the LSE
        dp = dot(do, tl.trans(v), DOT_PRECISION)    # dP = dO V^T
        if DROPOUT:
            keep = dropout_keep(seed, p_drop, drop_row0 + offs_q[:, None], tl.arange(0, BLOCK_KV)[None, :],
                                drop_col0 + kv_start, BLOCK_KV, DROPOUT)
            dp = tl.where(keep, dp * (1.0 / (1.0 - p_drop)), 0.0)
        ds = p * (dp - delta[:, None])                                 # dS (unscaled)
        if SOFTCAP:
            ds = ds * dcap
        dq = dot_acc(ds.to(k.dtype), k, dq, DOT_PRECISION)                # dQ += dS K
    return dq


@triton.jit(do_not_specialize=["n_heads", "n_q", "n_kv", "win_left", "win_right", "seed"])  # one binary for every length
def attn_bwd_dq(Q, K, V, dO, LSE, Delta, dQ,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_don, stride_dod,
                 stride_dqb, stride_dqh, stride_dqn, stride_dqd,
                 n_heads, n_q, n_kv, scale, qk_scale,
                 n_group, win_left, win_right, Programs, CuSeqQ, CuSeqK,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 WINDOW: tl.constexpr = False, VARLEN: tl.constexpr = False,
                 softcap=0.0, Slopes=None, stride_sb=0, stride_sh=0,
                 Mask=None, stride_mb=0, stride_mh=0, stride_mq=0, stride_mk=0, seed=0, p_drop=0.0,
                 Lists=None, stride_lb=0, stride_lh=0, stride_lr=0,
                 SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                 DROPOUT: tl.constexpr = 0, BOTTOM_RIGHT: tl.constexpr = False):
    # The forward kernel's grid and its grouped heads and packed sequences (see attn_fwd).
    q_block = tl.program_id(0)
    if IS_CAUSAL and not VARLEN:  # the last query blocks visit the most keys: start them first
        q_block = tl.num_programs(0) - 1 - q_block
    head, batch = tl.program_id(1), tl.program_id(2)
    kv_head = head // n_group
    Q += batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    K += batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V += batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    dO += batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    dQ += batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
    LSE += (batch.to(tl.int64) * n_heads + head) * n_q
    Delta += (batch.to(tl.int64) * n_heads + head) * n_q
    drop_row0 = (batch.to(tl.int64) * n_heads + head) * n_q  # dropout's rows, as in attn_fwd
    drop_col0 = 0
    if VARLEN:  # move to this program's sequence; from here on n_q and n_kv are its lengths
        q_block, q_offset, n_q, kv_offset, n_kv = sequence_of_program(Programs, CuSeqQ, CuSeqK,
                                                                      q_block)
        Q += q_offset * stride_qn
        dO += q_offset * stride_don
        dQ += q_offset * stride_dqn
        LSE += q_offset
        Delta += q_offset
        K += kv_offset * stride_kn
        V += kv_offset * stride_vn
        drop_row0 += q_offset
        drop_col0 = kv_offset
    shift, win_left, win_right, slope = score_mod_setup(n_q, n_kv, win_left, win_right, batch, head,
                                                        Programs, Slopes, stride_sb, stride_sh,
                                                        ALIBI, VARLEN, BOTTOM_RIGHT)
    if MASK_KIND != 0:
        Mask += batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh

    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)    # Q and K's head dim (dQ's)
    offs_dv = tl.arange(0, BLOCK_DV)  # V and dO's, which may differ
    q = load_tile(Q, offs_q, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, True, HEAD_DIM < BLOCK_D)
    do = load_tile(dO, offs_q, offs_dv, stride_don, stride_dod, n_q, HEAD_DIM_V, True, HEAD_DIM_V < BLOCK_DV)
    lse = tl.load(LSE + offs_q, mask=offs_q < n_q, other=0.0)
    if LSE.dtype.element_ty == tl.float64:
        # The LSE to more than float32's precision: P = 2**(S' - hi) * 2**-lo, and dQ is linear in
        # P, so the loop uses hi and dQ is multiplied by 2**-lo once, at the end.
        lse_hi = lse.to(tl.float32)
        finite = tl.abs(lse_hi) < float("inf")  # a row that saw no key: no low part
        lse_lo = (tl.where(finite, lse, 0.0) - tl.where(finite, lse_hi, 0.0).to(tl.float64)).to(tl.float32)
        row_factor = tl.exp2(-lse_lo)
        lse = lse_hi
    else:
        row_factor = tl.full([BLOCK_Q], 1.0, dtype=tl.float32)
    delta = tl.load(Delta + offs_q, mask=offs_q < n_q, other=0.0)
    if WINDOW or VARLEN or MASK_KIND != 0:  # a row that saw no key has LSE -inf: 2**(-inf - +inf) = 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    # The same stages as the forward kernel (with an attn_mask, the same tile lists).
    if MASK_KIND != 0:
        Tiles = Lists + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_block * stride_lr
        n_full = tl.load(Tiles)
        n_listed = n_full + tl.load(Tiles + 1)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, 0, n_full * BLOCK_KV, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, IS_CAUSAL, DOT_PRECISION, WINDOW,
                       win_left, win_right, n_q=n_q, shift=shift, softcap=softcap, slope=slope, seed=seed,
                       p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0, Tiles=Tiles + 2,
                       SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT, LISTED=True)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, n_full * BLOCK_KV, n_listed * BLOCK_KV, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, IS_CAUSAL, DOT_PRECISION, WINDOW,
                       win_left, win_right, n_q=n_q, shift=shift, softcap=softcap, slope=slope, Mask=Mask,
                       stride_mq=stride_mq, stride_mk=stride_mk, seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, Tiles=Tiles + 2, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                       MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, LISTED=True)
    elif WINDOW:
        kv_lo, kv_full_lo, kv_full_hi, kv_hi = kv_window_bounds(q_start, n_kv, win_left, win_right,
                                                                BLOCK_Q, BLOCK_KV)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, kv_lo, kv_full_lo, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, False, DOT_PRECISION, True, win_left,
                       win_right, n_q=n_q, shift=shift, softcap=softcap, slope=slope,
                       seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, kv_full_lo, kv_full_hi, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, False, DOT_PRECISION, True, win_left,
                       win_right, n_q=n_q, shift=shift, softcap=softcap, slope=slope,
                       seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, kv_full_hi, kv_hi, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, False, DOT_PRECISION, True, win_left,
                       win_right, n_q=n_q, shift=shift, softcap=softcap, slope=slope,
                       seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
    else:
        kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, 0, kv_full_end, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, IS_CAUSAL, DOT_PRECISION,
                       n_q=n_q, shift=shift, softcap=softcap, slope=slope,
                       seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
        dq = dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_q, offs_d, offs_dv, kv_full_end, kv_end, n_kv, qk_scale,
                       HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, IS_CAUSAL, DOT_PRECISION,
                       n_q=n_q, shift=shift, softcap=softcap, slope=slope,
                       seed=seed, p_drop=p_drop, drop_row0=drop_row0,
                       drop_col0=drop_col0, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)

    dq *= scale * row_factor[:, None]
    store_tile(dQ, dq, offs_q, offs_d, stride_dqn, stride_dqd, n_q, HEAD_DIM, HEAD_DIM < BLOCK_D)


def attention_backward(q, k, v, o, lse2, do, is_causal, scale, dlse=None, configs=None,
                       window_size=(-1, -1), sequences=None, dkdv=None, mods=None, fused=None):
    """Launch the three backward kernels on (B, H, N, D) tensors of any strides.

    ``lse2`` is the forward's base-2 log-sum-exp. ``dlse``, if given, is the gradient reaching the
    natural-log LSE output: since d lse_i / d S_ij = P_ij, it only shifts Delta (Delta - dlse).
    ``configs`` may fix the tiles per kernel: ``{"bwd_dkdv": {...}, "bwd_dq": {...}, ...}``.
    ``k``/``v`` with fewer heads than ``q``, ``window_size`` and ``sequences`` as in
    ``forward.attention_forward``. ``dkdv``, if given, computes dK and dV in place of the Triton
    kernel: ``dkdv(q, k, v, do, lse2, delta, is_causal, scale) -> (dk, dv)`` (``flashattn.ops.dispatch``
    passes the Gluon kernel of ``flashattn.hopper.backward`` there); ``fused``, if given, computes
    all three after Delta: ``fused(q, k, v, do, lse2, delta, is_causal, scale) -> (dq, dk, dv)``.
    Returns ``(dq, dk, dv)`` in the dtypes of q, k and v. ``mods`` (a
    ``flashattn.kernels.mods.ScoreMods``): the forward's.
    """
    configs = configs or {}
    batch, heads, n_q, head_dim = q.shape
    heads_kv, n_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    dtypes = q.dtype, k.dtype, v.dtype
    q, k, v, o, do = kernel_dtype(q, k, v, o, do)
    dq = torch.empty_like(q)
    if n_q == 0 or n_kv == 0:
        return tuple(torch.zeros_like(t, dtype=d) for t, d in zip((q, k, v), dtypes))
    mods = mods or NO_MODS
    causal, window, win_left, win_right = window_masking(
        is_causal, window_size, n_q + n_kv, mods.aligned_bottom_right(n_q, n_kv, sequences is not None))
    mod_args = mods.kernel_args(n_q, n_kv, sequences is not None)
    dims = head_dims(head_dim, head_dim_v)
    masking = dict(dims, IS_CAUSAL=causal,
                   DOT_PRECISION=dot_precision(q.dtype, tile_block_d(dims)),
                   WINDOW=window, VARLEN=sequences is not None)
    seq_len = max(n_q, n_kv)
    variants = (heads // heads_kv, win_left, win_right)
    lists = {}
    listed = [] if mods.attn_mask is None or fused is not None else ["bwd_dq"] + (["bwd_dkdv"] if dkdv is None else [])
    if listed:  # the mask's tile lists depend on the tiles: they are fixed first, the mask read once for both
        configs = dict(configs, **{name: configs.get(name) or launcher.fixed_config(name, q.dtype, masking)
                                   for name in listed})
        lists = mods.mask_lists(n_q, n_kv, {name: configs[name] for name in listed}, causal, window,
                                win_left, win_right)

    delta = torch.empty_like(lse2, dtype=torch.float32)
    launcher.launch(  # rows are independent here: packed sequences need no table
        "bwd_preprocess", attn_bwd_preprocess,
        lambda meta: (triton.cdiv(n_q, meta["BLOCK_Q"]), heads, batch),
        (o, do, delta, *o.stride(), *do.stride(), heads, n_q),  # Delta = rowsum(dO * O): v's head dim
        dict(HEAD_DIM=head_dim_v, BLOCK_D=block_d(head_dim_v)), seq_len, configs.get("bwd_preprocess"))
    if dlse is not None:
        delta -= dlse
    if fused is not None:
        return tuple(t.to(d) for t, d in zip(fused(q, k, v, do, lse2, delta, causal, scale), dtypes))

    def grid_and_tables(name, side, block_name, blocks, grid_heads):
        """The grid and the table arguments of the dK/dV (side "kv") or dQ (side "q") kernel."""
        config = configs.get(name)
        if sequences is None:
            return config, (lambda meta: (triton.cdiv(blocks, meta[block_name]), grid_heads, batch)), \
                (None, None, None)
        config = config or sequences.config(name, q.dtype, masking)
        table = sequences.programs(side, config[block_name], win_left, win_right)
        return config, (table.shape[0], grid_heads, 1), \
            (table, sequences.cu_seqlens_q, sequences.cu_seqlens_k)

    if dkdv is not None:
        dk, dv = dkdv(q, k, v, do, lse2, delta, causal, scale)
    else:
        # Every element of dK and dV is written by a program (zeros where no query looks).
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        config, grid, tables = grid_and_tables("bwd_dkdv", "kv", "BLOCK_KV", n_kv, heads_kv)
        launcher.launch(
            "bwd_dkdv", attn_bwd_dkdv, grid,
            (q, k, v, do, lse2, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
             *dk.stride(), *dv.stride(), heads, n_q, n_kv, scale, qk_scale(scale), *variants, *tables),
            dict(masking, **{**mod_args, **lists.get("bwd_dkdv", {})}), seq_len, _checked_dkdv(config))
    config, grid, tables = grid_and_tables("bwd_dq", "q", "BLOCK_Q", n_q, heads)
    launcher.launch(
        "bwd_dq", attn_bwd_dq, grid,
        (q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
         *dq.stride(), heads, n_q, n_kv, scale, qk_scale(scale), *variants, *tables),
        dict(masking, **{**mod_args, **lists.get("bwd_dq", {})}), seq_len, config)
    return tuple(t.to(d) for t, d in zip((dq, dk, dv), dtypes))


def _checked_dkdv(config):
    if config is not None and not dkdv_steps_fit(config["BLOCK_Q"], config["BLOCK_KV"]):
        raise ValueError(f"bwd_dkdv config {config}: BLOCK_Q must divide BLOCK_KV, because the "
                         "query loop starts at the diagonal of each key block")
    return config
