"""Experiment (not part of the package): the forward kernel with K and V loaded through tensor
descriptors (Hopper's TMA copy engine) instead of pointer tiles, to measure what TMA buys.
Contiguous (B, H, N, D) inputs only; fixed configs. Run by ``experiments/perf_probe.py --tma``.
Kept as measured: it writes out the stage bounds that the package kernels take from
``flashattn.kernels.tiles.kv_stage_bounds``."""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashattn.kernels.tiles import LOG2E


@triton.jit
def _inner(acc, m_i, l_i, q, desc_k, desc_v, bh, offs_q, kv_lo, kv_hi, n_kv, qk_scale,
           BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr):
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        kv_start = tl.multiple_of(kv_start, BLOCK_KV)
        k = desc_k.load([bh, kv_start, 0]).reshape(BLOCK_KV, BLOCK_D)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            offs_kv = kv_start + tl.arange(0, BLOCK_KV)
            visible = offs_kv[None, :] < n_kv
            if IS_CAUSAL:
                visible = visible & (offs_q[:, None] >= offs_kv[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([bh, kv_start, 0]).reshape(BLOCK_KV, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_q", "n_kv"])
def _fwd_tma(desc_q, desc_k, desc_v, desc_o, LSE, n_q, n_kv, qk_scale,
             BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    q_block = tl.program_id(0)
    if IS_CAUSAL:
        q_block = tl.num_programs(0) - 1 - q_block
    bh = tl.program_id(1)
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    q = desc_q.load([bh, q_start, 0]).reshape(BLOCK_Q, BLOCK_D)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        kv_end = tl.minimum(q_start + BLOCK_Q, n_kv)
        kv_full_end = tl.minimum(q_start, n_kv) // BLOCK_KV * BLOCK_KV
    else:
        kv_end = n_kv
        kv_full_end = n_kv // BLOCK_KV * BLOCK_KV
    acc, m_i, l_i = _inner(acc, m_i, l_i, q, desc_k, desc_v, bh, offs_q, 0, kv_full_end, n_kv, qk_scale,
                           BLOCK_D, BLOCK_KV, False, IS_CAUSAL)
    acc, m_i, l_i = _inner(acc, m_i, l_i, q, desc_k, desc_v, bh, offs_q, kv_full_end, kv_end, n_kv, qk_scale,
                           BLOCK_D, BLOCK_KV, True, IS_CAUSAL)
    acc = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * n_q + offs_q, m_i + tl.log2(l_i), mask=offs_q < n_q)
    desc_o.store([bh, q_start, 0], acc.to(desc_o.dtype).reshape(1, BLOCK_Q, BLOCK_D))


def forward_tma(q, k, v, causal, scale, BLOCK_Q=128, BLOCK_KV=64, num_warps=8, num_stages=3):
    B, H, N, D = q.shape
    n_kv = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    views = [t.view(B * H, t.shape[2], D) for t in (q, k, v, o)]
    dq, dk, dv, do = (TensorDescriptor.from_tensor(t, [1, bs, D]) for t, bs in
                      zip(views, (BLOCK_Q, BLOCK_KV, BLOCK_KV, BLOCK_Q)))
    grid = (triton.cdiv(N, BLOCK_Q), B * H)
    _fwd_tma[grid](dq, dk, dv, do, lse, N, n_kv, scale * LOG2E, BLOCK_D=D, BLOCK_Q=BLOCK_Q,
                   BLOCK_KV=BLOCK_KV, IS_CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)
    return o, lse
