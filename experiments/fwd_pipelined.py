"""Experiment (not part of the package): the forward loop reordered by hand so that the P V
matmul of one tile can run while the softmax of the next executes ("intra-warpgroup pipelining",
as in FlashAttention-3): S_j is issued, then P_{j-1} V_{j-1}, then the softmax of S_j. Only the unmasked stage is pipelined; the masked stage is the package's own loop.
Contiguous (B, H, N, D) inputs, head dim a power of two. Run by
``experiments/perf_probe.py --pipelined``.

Kept as measured: it writes out the stage bounds that the package kernels take from
``flashattn.kernels.tiles.kv_stage_bounds``."""
import torch
import triton
import triton.language as tl

from flashattn.kernels.forward import fwd_inner
from flashattn.kernels.tiles import LOG2E


@triton.jit
def _inner_pipelined(acc, m_i, l_i, q, K, V, offs_kv0, offs_d, kv_lo, kv_hi, qk_scale,
                     BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr):
    # Prologue: the softmax of the first tile (kv_lo < kv_hi is checked by the caller).
    k = tl.load(K + (kv_lo + offs_kv0)[:, None] * BLOCK_D + offs_d[None, :])
    s = tl.dot(q, tl.trans(k))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    m_i = m_new
    # Steady state: issue S of tile j, then P V of tile j-1, then the softmax of tile j, which
    # needs S but not P V: a wait that lets P V run on while exp2 and the row sums execute.
    for kv_start in range(kv_lo + BLOCK_KV, kv_hi, BLOCK_KV):
        kv_start = tl.multiple_of(kv_start, BLOCK_KV)
        k = tl.load(K + (kv_start + offs_kv0)[:, None] * BLOCK_D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        v = tl.load(V + (kv_start - BLOCK_KV + offs_kv0)[:, None] * BLOCK_D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    # Epilogue: P V of the last tile.
    v = tl.load(V + (kv_hi - BLOCK_KV + offs_kv0)[:, None] * BLOCK_D + offs_d[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_q", "n_kv"])
def _fwd_pipelined(Q, K, V, O, LSE, n_q, n_kv, qk_scale,
                   BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                   IS_CAUSAL: tl.constexpr):
    q_block = tl.program_id(0)
    if IS_CAUSAL:
        q_block = tl.num_programs(0) - 1 - q_block
    bh = tl.program_id(1).to(tl.int64)
    Q += bh * n_q * BLOCK_D
    O += bh * n_q * BLOCK_D
    K += bh * n_kv * BLOCK_D
    V += bh * n_kv * BLOCK_D
    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_kv0 = tl.arange(0, BLOCK_KV)
    q = tl.load(Q + offs_q[:, None] * BLOCK_D + offs_d[None, :])
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        kv_end = tl.minimum(q_start + BLOCK_Q, n_kv)
        kv_full_end = tl.minimum(q_start, n_kv) // BLOCK_KV * BLOCK_KV
    else:
        kv_end = n_kv
        kv_full_end = n_kv // BLOCK_KV * BLOCK_KV
    if kv_full_end > 0:
        acc, m_i, l_i = _inner_pipelined(acc, m_i, l_i, q, K, V, offs_kv0, offs_d, 0, kv_full_end,
                                         qk_scale, BLOCK_D, BLOCK_KV)
    acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, BLOCK_D, 1, BLOCK_D, 1,
                               offs_q, offs_d, offs_d, kv_full_end, kv_end, n_kv, qk_scale,
                               BLOCK_D, BLOCK_D, BLOCK_D, BLOCK_D, BLOCK_KV, True, IS_CAUSAL, "ieee")
    acc = acc / l_i[:, None]
    tl.store(LSE + bh * n_q + offs_q, m_i + tl.log2(l_i))
    tl.store(O + offs_q[:, None] * BLOCK_D + offs_d[None, :], acc.to(O.dtype.element_ty))


def forward_pipelined(q, k, v, causal, scale, block_q, block_kv, num_warps, num_stages):
    """(o, lse2) for contiguous (B, H, N, D) q, k, v with N a multiple of both tile sizes."""
    b, h, n_q, d = q.shape
    n_kv = k.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert n_q % block_q == 0 and n_kv % block_kv == 0 and d == triton.next_power_of_2(d)
    o = torch.empty_like(q)
    lse2 = torch.empty((b, h, n_q), device=q.device, dtype=torch.float32)
    _fwd_pipelined[(n_q // block_q, b * h)](q, k, v, o, lse2, n_q, n_kv, scale * LOG2E,
                                           BLOCK_D=d, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=causal,
                                           num_warps=num_warps, num_stages=num_stages)
    return o, lse2
