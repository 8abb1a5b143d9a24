"""The forward pass for Hopper GPUs (sm_90), written in Gluon: FlashAttention-3's structure.

``flashattn.forward`` is the kernel the course teaches: one program streams K and V past its
block of queries and the compiler decides how loads and matmuls overlap. On an H100/H200 that
reaches about 0.8-0.95x of cuDNN, because exp2 and the row reductions sit between the two matmuls
of every step. This kernel schedules the same computation by hand, in Gluon (Triton's lower-level
language, ``triton.experimental.gluon``, where the program says which warps do what, where each
tile lives and when to wait):

* **TMA**: a *producer* warp copies K and V tiles from global to shared memory with the Tensor
  Memory Accelerator, into a ring of ``STAGES`` buffers. Each buffer has two mbarriers: *ready*
  (the copy engine signals it when the bytes have landed) and *empty* (the consumers signal it
  when they are done with the tile). The copy engine also checks bounds: rows past the end of the
  sequence read as zeros, so no masks are needed on loads, whatever the tensors' strides.
* **Asynchronous wgmma**: ``S = Q K^T`` and ``O += P V`` run on the tensor cores while the warps
  go on; a warp waits for a result only when it needs it.
* **Warp specialization**: two (or three) *consumer* warpgroups (4 warps each) own ``BLOCK_M``
  query rows each and share every K/V tile; the producer warp gives most of its registers to them
  (``setmaxnreg``). Within a warpgroup, the softmax of tile j runs while the tensor cores still
  compute ``P V`` of tile j-1.
* **Ping-pong** (``PINGPONG``): the consumers take turns to issue their matmuls (an mbarrier per
  consumer passes the turn), so that one's softmax runs while the other's matmuls occupy the
  tensor cores. Measured, it helps at head dim 128 and not at 64 (see ``CONFIGS``).

It computes what ``flashattn.forward.attention_forward`` computes (the output in q's dtype and the
base-2 LSE), with the same score modifications but the mask (softcap, ALiBi, windows, bottom-right
alignment, dropout with the Triton kernels' ``tiles.dropout_keep``: constexpr switches, off for a
plain call), so that either backward works unchanged. Gluon has no interpreter: these kernels run
only where they are compiled for CUDA (``flashattn.forward`` calls them; elsewhere it is only read).
"""
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..kernels.tiles import DROP_TILE, dropout_keep, qk_scale
from ..kernels.traversal import every_block_sees_keys
from .scores import capped, exp2_fma, modified_scores

# TMA's copies, under the names of the Triton at hand: Triton 3.9 calls them async_load and
# async_store (and removed async_copy_shared_to_global); 3.6 to 3.8 have only the old names.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

#: Head dims this kernel is compiled and tested for.
HEAD_DIMS = (64, 128)
#: Tile configuration per (head dim, causal): BLOCK_M query rows per consumer warpgroup, BLOCK_N
#: keys per K/V tile, STAGES K/V tiles in flight, PINGPONG whether the consumers take turns to
#: issue their matmuls. Chosen from the variants timed side by side on an H200 (torch 2.11,
#: triton 3.6), 2026-12-01, B=4, H=32, N=8192, fp16 and bf16 (figures/data/h200_gluon_forward.csv):
#: at head dim 64 ping-pong off won in all four settings (+3-5% over on); at head dim 128 it
#: stayed on, with 2 stages without the mask (+5% fp16, even bf16) and 3 with it (+3% on average).
#: At head dim 64 three consumer warpgroups (192 query rows) beat two on an H100 (triton 3.6,
#: 2026-12-06, tools/forward_variants.py, N=4k-16k, both dtypes, causal or not): +5-14% in 10 of 12
#: settings, even at N=4096 causal (docs/gpu-record/2026-12-06-2330-forward-variants-h100.txt).
CONFIGS = {
    (64, False): dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, PINGPONG=False, CONSUMERS=3),
    (64, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, PINGPONG=False, CONSUMERS=3),
    (128, False): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, PINGPONG=True),
    (128, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=3, PINGPONG=True),
}
#: What a configuration may also set: CONSUMERS, the consumer warpgroups (2 or 3) sharing each
#: K/V tile; EXP2_FMA, every how many tiles a consumer computes exp2 with a polynomial on the FMA
#: units instead of the special-function unit (0: never); TANH_APPROX, the softcap's tanh
#: (:data:`TANH_APPROX`); TRIM, whether a consumer skips the tiles that hold no pair of its rows
#: (:func:`_tiles_of`: on an H100, head dim 64, 1.06-1.07x the forward at N = 4096, causal, the same
#: speed elsewhere; docs/gpu-record/2026-12-07-0822-forward-trim-h100.txt).
DEFAULTS = dict(CONSUMERS=2, EXP2_FMA=0, TRIM=True)
#: What a call with a softcap, ALiBi, a window or dropout changes: at head dim 64 a third consumer's
#: 160 registers spill (sm_90, Triton 3.9, bf16: 88 bytes with causal ALiBi, 208-584 with dropout,
#: 128 with a softcap, ALiBi and a window), so these calls keep two consumers of 240.
MODIFIED_CONFIGS = {64: dict(CONSUMERS=2), 128: {}}
#: Whether the softcap's tanh is the special-function unit's ``tanh.approx.f32`` (one instruction,
#: relative error about 2**-11, as FlashAttention-3's softcap), in the forward and both backward
#: kernels, rather than the exact formula (an exp2, a division and a polynomial). Timed on an H100
#: (bf16, causal, B = 4, H = 32, N = 8192, cap 50; Triton 3.9, one run): the forward at 0.81x the
#: plain call's speed where the exact formula (on the Triton forward, faster there) ran at 0.41x,
#: the backward at 0.72x where it ran at 0.63x. Checked against float64 under the rule on an H100
#: (``gpu_checks`` ``gluon_mods --tanh-approx 1``, the softcap cases, both 16-bit dtypes, head dims
#: 64 and 128): the worst at 0.10 of the bound, as with the exact formula. Both
#: Gluon backward kernels read it at their launch; the Triton kernels keep the exact tanh (where
#: they compute a backward, its P then differs from the forward's in the approximation's last
#: bits, within the same rule).
TANH_APPROX = True
#: Registers per thread, per number of consumers: at launch (every warp of the program shares the
#: 64K registers of an SM; one producer warp takes a warpgroup's slot), then after setmaxnreg:
#: the producer gives most of its share to the consumers. 3 x 128 x 160 + 128 x 24 <= 65536.
REGISTERS = {2: dict(launch=168, consumer=240, producer=24),
             3: dict(launch=128, consumer=160, producer=24)}


def is_modified(window=None, softcap=0.0, alibi_slopes=None, shift=0, dropout_p=0.0, seed=0, key_mask=None):
    """Whether a call's modifications take MODIFIED_CONFIGS (``shift``, ``seed`` and the backward's
    ``key_mask`` alone do not: a key mask adds one load per key, no register per score)."""
    return window is not None or softcap > 0 or alibi_slopes is not None or dropout_p > 0


def tile_config(head_dim, causal, overrides=None, modified=False):
    """The full configuration for (head dim, causal): DEFAULTS, CONFIGS, MODIFIED_CONFIGS if
    ``modified`` (a softcap, ALiBi, a window or dropout), then ``overrides``."""
    cfg = dict(DEFAULTS, **CONFIGS[head_dim, bool(causal)])
    if modified:
        cfg.update(MODIFIED_CONFIGS[head_dim])
    cfg.update(overrides or {})
    if cfg["CONSUMERS"] not in REGISTERS:
        raise ValueError(f"CONSUMERS must be one of {sorted(REGISTERS)}, got {cfg['CONSUMERS']}")
    return cfg


# ---------------------------------------------------------------------------- layouts


@gluon.constexpr_function
def mma_layout(n):
    """Accumulator layout of a wgmma whose result has ``n`` columns, for one warpgroup (4 warps
    along the rows: 16 rows per warp and instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# ---------------------------------------------------------------------------- partitions


@gluon.jit
def _tiles_of(C, q_start, n_q, n_kv, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              IS_CAUSAL: gl.constexpr, TRIM: gl.constexpr):
    """How many of the program's ``n_tiles`` K/V tiles consumer C computes: with TRIM, not those
    past its last row's diagonal under the causal mask, and only the first for rows past the end:
    they hold no pair it keeps. The diagonal's tiles are counted from key 0, exact where kv_lo is 0
    (causal alone) and never fewer than needed where a window starts the tiles later. Not with
    ping-pong, whose turn passes through every consumer at every tile."""
    n = n_tiles
    if TRIM:
        if IS_CAUSAL:
            n = gl.minimum(gl.cdiv(gl.minimum(q_start + (C + 1) * BLOCK_M, n_kv), BLOCK_N), n_tiles)
        if q_start + C * BLOCK_M >= n_q:
            n = 1
    return n


@gluon.jit
def _load_tile(desc, smem, ready, empty, batch, head, kv_lo, j, q_start, n_q, n_kv, n_tiles, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr,
               TRIM: gl.constexpr):
    """Copy tile j of K or V (the keys from ``kv_lo + j * BLOCK_N``) into its slot of the ring,
    once the consumers have released it; with TRIM, release it at once for each consumer that
    does not compute it (:func:`_tiles_of`)."""
    stage = j % STAGES
    # An mbarrier starts as if its phase of parity 1 had just completed, so the first round
    # through the ring does not wait; later rounds wait for both consumers' release.
    mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
    tma_load(desc, [batch, head, kv_lo + j * BLOCK_N, 0], ready.index(stage), smem.index(stage))
    if TRIM:
        for c in gl.static_range(CONSUMERS):
            mbarrier.arrive(empty.index(stage),
                            pred=j >= _tiles_of(c, q_start, n_q, n_kv, n_tiles, BLOCK_M, BLOCK_N, IS_CAUSAL, TRIM))


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty,
              v_empty, batch, head, kv_head, q_start, kv_lo, n_tiles, n_q, n_kv,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr, TRIM: gl.constexpr):
    """One warp: the queries of every consumer once, then K and V tile by tile into the ring, in
    the order the consumers use them (K_j together with V_{j-1}). The keys and values are those of
    ``kv_head``, the query head's group under grouped-query attention (else the head itself)."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(c), desc_q.block_type.nbytes)
        tma_load(desc_q, [batch, head, q_start + c * BLOCK_M, 0], q_ready.index(c), q_smem.index(c))
    _load_tile(desc_k, k_smem, k_ready, k_empty, batch, kv_head, kv_lo, 0, q_start, n_q, n_kv, n_tiles,
               BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIM)
    for j in range(1, n_tiles):
        _load_tile(desc_k, k_smem, k_ready, k_empty, batch, kv_head, kv_lo, j, q_start, n_q, n_kv, n_tiles,
                   BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIM)
        _load_tile(desc_v, v_smem, v_ready, v_empty, batch, kv_head, kv_lo, j - 1, q_start, n_q, n_kv, n_tiles,
                   BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIM)
    _load_tile(desc_v, v_smem, v_ready, v_empty, batch, kv_head, kv_lo, n_tiles - 1, q_start, n_q, n_kv, n_tiles,
               BLOCK_M, BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIM)


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_q, kv_start, kv_full_lo, kv_full_hi, n_kv, qk_scale, on_fma,
                  win_left, win_right, softcap, slope, shift, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, EXP2_FMA: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, TANH_APPROX: gl.constexpr):
    """Fold the scores ``s`` of one tile into the running max and sum: ``(p, m_new, l_new,
    alpha)``, exactly as ``flashattn.forward.fwd_inner`` does (base 2, scale folded into exp2).
    With EXP2_FMA, ``on_fma`` says whether this tile's exponentials go to the FMA units. Tiles
    outside ``[kv_full_lo, kv_full_hi)`` are masked: the causal diagonal, the ragged end and, with
    WINDOW, both edges of the sliding window (``tiles.kv_window_bounds``), scores once modified."""
    offs_kv = kv_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    if SOFTCAP and not ALIBI:  # the cap's factor to base 2 joins exp2's fused multiply-add
        s = capped(s, qk_scale, softcap, TANH_APPROX)
        scale2 = softcap * 1.4426950408889634
    elif SOFTCAP or ALIBI:
        s, _ = modified_scores(s, gl.expand_dims(offs_q, 1), gl.expand_dims(offs_kv, 0), qk_scale, softcap,
                               slope, shift, SOFTCAP, ALIBI, TANH_APPROX)
        scale2 = 1.0  # the scores are in base 2 already
    else:
        scale2 = qk_scale
    masked = kv_start >= kv_full_hi
    if WINDOW:
        masked = masked | (kv_start < kv_full_lo)
    if masked:
        visible = gl.expand_dims(offs_kv, 0) < n_kv
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(offs_q, 1) >= gl.expand_dims(offs_kv, 0))
        if WINDOW:
            visible = visible & (gl.expand_dims(offs_kv, 0) >= gl.expand_dims(offs_q, 1) - win_left) \
                & (gl.expand_dims(offs_kv, 0) <= gl.expand_dims(offs_q, 1) + win_right)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale2)
    if WINDOW:  # a row may meet only hidden keys before its first visible one (fwd_inner's m_ref)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    x = s * scale2 - gl.expand_dims(m_ref, 1)
    if EXP2_FMA > 0:
        if on_fma:
            p = exp2_fma(x)
        else:
            p = gl.exp2(x)
    else:
        p = gl.exp2(x)
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer(desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, turn,
              LSE,
              batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi, qk_scale,
              win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
              C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr, EXP2_FMA: gl.constexpr,
              WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
              TANH_APPROX: gl.constexpr, DROPOUT: gl.constexpr, TRIM: gl.constexpr):
    """One warpgroup: rows ``q_start + C * BLOCK_M`` to ``+ BLOCK_M`` of the output.

    The loop is software-pipelined by one tile: in step j it issues ``S_j = Q K_j^T`` and
    ``O += P_{j-1} V_{j-1}``, waits for S_j only, and computes the softmax of tile j while the
    tensor cores still work on P V. With PINGPONG the consumers issue in turn (C, then C + 1, ...):
    consumer C waits for its mbarrier ``turn[C]`` and, once its matmuls are issued, passes the turn.

    DROPOUT drops probabilities from ``P V`` after they joined the row sums (``tiles.dropout_keep``
    on the dropout rows ``drop_row0 + i``: the same pairs as the Triton kernels drop).

    With TRIM it stops after its own tiles (:func:`_tiles_of`); the producer releases the rest for it.
    """
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = desc_o.dtype
    NEXT: gl.constexpr = (C + 1) % CONSUMERS

    q = q_smem.index(C).reshape([BLOCK_M, HEAD_DIM])
    offs_q = q_start + C * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    # Dropout's rows and a tile's column offsets, built once here: drawn inside _softmax_step, the
    # compiled kernel rebuilt the offsets for every tile.
    drop_rows = gl.expand_dims(drop_row0 + offs_q, 1)
    drop_cols = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    n_mine = _tiles_of(C, q_start, n_q, n_kv, n_tiles, BLOCK_M, BLOCK_N, IS_CAUSAL, TRIM)
    mbarrier.wait(q_ready.index(C), 0)

    # Tile 0: S, then its softmax (nothing to overlap with yet).
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(C), 0)
    k = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(NEXT))
    s = warpgroup_mma_wait(0, deps=[s])
    mbarrier.arrive(k_empty.index(0))
    # With EXP2_FMA = E, consumer C takes the FMA path on tiles j with j % E == C % E, so that
    # the consumers do not all load the same unit at once.
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_q, kv_lo, kv_full_lo, kv_full_hi, n_kv, qk_scale,
                                       C % gl.maximum(EXP2_FMA, 1) == 0, win_left, win_right,
                                       softcap, slope, shift, BLOCK_N, IS_CAUSAL, EXP2_FMA, WINDOW,
                                       SOFTCAP, ALIBI, TANH_APPROX)
    if DROPOUT:
        p = gl.where(dropout_keep(seed, p_drop, drop_rows, drop_cols, kv_lo, BLOCK_N, DROPOUT), p, 0.0)
    p = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_mine):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(C), j & 1)
        k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(NEXT))
        s = warpgroup_mma_wait(1, deps=[s])  # S_j is ready; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(stage))
        p_next, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_q, kv_lo + j * BLOCK_N, kv_full_lo,
                                                kv_full_hi, n_kv, qk_scale,
                                                j % gl.maximum(EXP2_FMA, 1) == C % gl.maximum(EXP2_FMA, 1),
                                                win_left, win_right, softcap, slope, shift, BLOCK_N,
                                                IS_CAUSAL, EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX)
        if DROPOUT:
            p_next = gl.where(dropout_keep(seed, p_drop, drop_rows, drop_cols, kv_lo + j * BLOCK_N, BLOCK_N,
                                           DROPOUT), p_next, 0.0)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # p's registers stay live until here
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p_next.to(dtype), p_layout)

    last = (n_mine - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_mine - 1) // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(C), n_mine & 1)
    v = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
    acc = warpgroup_mma(p, v, acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(NEXT))
    acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    mbarrier.arrive(v_empty.index(last))

    # Normalise once, keep LSE = M + log2(L), and write O through the Q buffer (no longer read).
    if WINDOW:  # a row that saw no key (a padding row past n_q): output 0, LSE -inf, not NaN
        l_i = gl.where(l_i == 0.0, 1.0, l_i)
    lse = m_i + gl.log2(l_i)
    gl.store(LSE + offs_q, lse, mask=offs_q < n_q)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    if DROPOUT:  # the kept probabilities scaled by 1 / (1 - p): O's expectation is P V
        l_o = l_o * (1.0 - p_drop)
    o = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    q.store(o)
    fence_async_shared()
    tma_store(desc_o, [batch, head, q_start + C * BLOCK_M, 0], q_smem.index(C))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_q", "n_kv", "win_left", "win_right", "shift", "stride_sb", "stride_sh",
                              "seed"])
def attn_fwd_sm90(desc_q, desc_k, desc_v, desc_o, LSE, n_heads, n_q, n_kv, qk_scale, n_group,
                   win_left, win_right, shift, softcap, Slopes, stride_sb, stride_sh, seed, p_drop,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                   CONSUMERS: gl.constexpr, EXP2_FMA: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WINDOW: gl.constexpr = False,
                   SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
                   TANH_APPROX: gl.constexpr = False, DROPOUT: gl.constexpr = 0, TRIM: gl.constexpr = False):
    BLOCK_Q: gl.constexpr = CONSUMERS * BLOCK_M  # query rows per program
    q_block = gl.program_id(0)
    if IS_CAUSAL:  # the last query blocks visit the most keys: start them first
        q_block = gl.num_programs(0) - 1 - q_block
    head = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = head // n_group  # grouped-query attention: n_group query heads share a K/V head
    q_start = q_block * BLOCK_Q
    drop_row0 = (batch.to(gl.int64) * n_heads + head) * n_q  # the (batch, head)'s first row
    LSE += drop_row0
    if ALIBI:  # the head's slope (row ``batch`` of the slopes, or their one row: stride 0)
        slope = gl.load(Slopes + batch.to(gl.int64) * stride_sb + head.to(gl.int64) * stride_sh)
    else:
        slope = 0.0
    # The key tiles [kv_lo, kv_hi), whole ones (no mask) in [kv_full_lo, kv_full_hi): the stages of
    # flashattn.tiles.kv_stage_bounds, or under a sliding window those of tiles.kv_window_bounds,
    # for the program's BLOCK_Q rows. The bounds come shifted where positions align bottom-right
    # (``traversal.aligned_bounds``), and ``supports`` takes only windows where every program has a
    # tile (``traversal.every_block_sees_keys``).
    if WINDOW:
        kv_lo = gl.maximum(q_start - win_left, 0) // BLOCK_N * BLOCK_N
        kv_hi = gl.minimum(q_start + BLOCK_Q + win_right, n_kv)
        kv_full_lo = gl.maximum(q_start + BLOCK_Q - 1 - win_left + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
        kv_full_hi = gl.minimum(q_start + win_right + 1, n_kv) // BLOCK_N * BLOCK_N
        kv_full_lo = gl.minimum(gl.maximum(kv_full_lo, kv_lo), kv_hi)
        kv_full_hi = gl.maximum(kv_full_hi, kv_full_lo)
    elif IS_CAUSAL:
        kv_lo = 0
        kv_full_lo = 0
        kv_hi = gl.minimum(q_start + BLOCK_Q, n_kv)
        kv_full_hi = gl.minimum(q_start, n_kv) // BLOCK_N * BLOCK_N
    else:
        kv_lo = 0
        kv_full_lo = 0
        kv_hi = n_kv
        kv_full_hi = n_kv // BLOCK_N * BLOCK_N
    n_tiles = gl.cdiv(kv_hi - kv_lo, BLOCK_N)
    TRIMS: gl.constexpr = TRIM and not PINGPONG  # each consumer only its own tiles (_tiles_of)

    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    if PINGPONG:
        mbarrier.arrive(turn.index(0))  # consumer 0 issues first

    # Consumer 0 runs in the program's own 4 warps, the rest are workers (partitions spelled out).
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    C2: gl.constexpr = 2
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                         turn, LSE, batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi,
                         qk_scale, win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
                         C0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, CONSUMERS,
                         EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX, DROPOUT, TRIMS)),
            (_consumer, (desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                         turn, LSE, batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi,
                         qk_scale, win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
                         C1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, CONSUMERS,
                         EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX, DROPOUT, TRIMS)),
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                         k_empty, v_empty, batch, head, kv_head, q_start, kv_lo, n_tiles, n_q, n_kv, BLOCK_M,
                         BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIMS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                         turn, LSE, batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi,
                         qk_scale, win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
                         C0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, CONSUMERS,
                         EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX, DROPOUT, TRIMS)),
            (_consumer, (desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                         turn, LSE, batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi,
                         qk_scale, win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
                         C1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, CONSUMERS,
                         EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX, DROPOUT, TRIMS)),
            (_consumer, (desc_o, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                         turn, LSE, batch, head, q_start, n_q, n_kv, n_tiles, kv_lo, kv_full_lo, kv_full_hi,
                         qk_scale, win_left, win_right, softcap, slope, shift, seed, p_drop, drop_row0,
                         C2, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, CONSUMERS,
                         EXP2_FMA, WINDOW, SOFTCAP, ALIBI, TANH_APPROX, DROPOUT, TRIMS)),
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                         k_empty, v_empty, batch, head, kv_head, q_start, kv_lo, n_tiles, n_q, n_kv, BLOCK_M,
                         BLOCK_N, STAGES, CONSUMERS, IS_CAUSAL, TRIMS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------- host side


def _gl_dtype(dtype):
    return {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]


def block_layout(block_shape, dtype):
    """The shared-memory layout TMA writes a (1, 1, rows, head dim) block in: swizzled so that
    wgmma reads it without bank conflicts."""
    return gl.NVMMASharedLayout.get_default_for(block_shape, _gl_dtype(dtype))


def _tma_strides(t):
    """``t``'s strides for a tensor descriptor: a dim of size 1 is never stepped along, so its
    stride (which may be anything) is replaced by one TMA accepts."""
    return [math.prod(t.shape[i + 1:]) if t.shape[i] == 1 else s for i, s in enumerate(t.stride())]


def tma_ok(t):
    """TMA's rules: 16-byte aligned data, the last dim contiguous, the other strides multiples of
    16 bytes and not 0 (an expanded tensor repeats rows that TMA cannot repeat)."""
    strides = _tma_strides(t)
    return (t.data_ptr() % 16 == 0 and strides[-1] == 1
            and all(s > 0 and s * t.element_size() % 16 == 0 for s in strides[:-1]))


def supports(q, k, v, is_causal=False, scale=None, window=None):
    """Whether this kernel computes attention of these (B, H, N, D) tensors: on a CUDA GPU of
    compute capability 9.x, in fp16 or bf16, at head dim 64 or 128, with strides TMA accepts; k and
    v may have fewer heads than q (grouped-query attention: a divisor of q's), not another head
    dim. Under a sliding ``window`` every query block must see some key (the kernel's consumers
    start on a first tile), for the masked configuration's blocks."""
    if window is not None:
        cfg = tile_config(q.shape[-1], True, modified=True) if q.shape[-1] in HEAD_DIMS else None
        if cfg is None or not every_block_sees_keys(q.shape[2], k.shape[2], *window,
                                                    cfg["CONSUMERS"] * cfg["BLOCK_M"]):
            return False
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or q.dim() != 4:
        return False
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or v.shape[:2] != k.shape[:2]:
        return False
    if v.shape[-1] != q.shape[-1]:  # V and O are tiles of q's head dim here
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    if q.shape[-1] not in HEAD_DIMS or 0 in q.shape or 0 in k.shape:
        return False
    return all(tma_ok(t) for t in (q, k, v))


def slope_args(alibi_slopes, placeholder):
    """The kernels' ``Slopes, stride_sb, stride_sh``: ALiBi's ``(B or 1, H)`` slopes in place (a
    stride of 0 along a dim of size 1), or without them any float32 pointer, never read."""
    if alibi_slopes is None:
        return placeholder, 0, 0
    return (alibi_slopes, *(0 if alibi_slopes.shape[i] == 1 else alibi_slopes.stride(i) for i in (0, 1)))


def descriptor(t, rows):
    """A TMA descriptor for the (B, H, N, D) tensor ``t`` that copies blocks of ``rows`` rows."""
    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor(t, list(t.shape), _tma_strides(t), block, block_layout(block, t.dtype))


def launch_options(cfg):
    """The register budgets a configuration is compiled with: ``(constexprs, options)``."""
    regs = REGISTERS[cfg["CONSUMERS"]]
    return (dict(CONSUMER_REGS=regs["consumer"], PRODUCER_REGS=regs["producer"]),
            dict(num_warps=4, maxnreg=regs["launch"], enable_fp_fusion=True))  # as launcher.run


def attention_forward(q, k, v, is_causal, scale, config=None, window=None, softcap=0.0, alibi_slopes=None,
                      shift=0, dropout_p=0.0, seed=0):
    """``(o, lse2)`` like ``flashattn.kernels.forward.attention_forward``, for inputs ``supports``
    accepts (grouped heads too: query head ``h`` reads K/V head ``h // (H_q / H_kv)`` in place).
    ``config`` overrides entries of the configuration of (head dim, causal, modified): see
    :func:`tile_config` (and ``TANH_APPROX``, :data:`TANH_APPROX` by default).
    ``window = (left, right)`` (``traversal.window_masking``'s bounds, causal folded into
    ``right = 0``, moved by ``traversal.aligned_bounds`` where positions align bottom-right): a
    sliding window, with the masked configuration's tiles. ``softcap`` > 0 caps the scores;
    ``alibi_slopes`` (``(B or 1, H)``, float32) add ALiBi's biases at query positions ``i + shift``
    (``shift = N_kv - N_q`` aligned bottom-right, else 0). ``dropout_p`` > 0 drops the pairs the
    Triton kernels drop for ``seed`` (``tiles.dropout_keep``)."""
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    o = torch.empty_like(q)  # q's layout where q is dense, else contiguous: either suits TMA
    lse2 = torch.empty((batch, heads, n_q), device=q.device, dtype=torch.float32)
    cfg = tile_config(head_dim, is_causal or window is not None, config,
                      is_modified(window, softcap, alibi_slopes, shift, dropout_p, seed))
    tanh_approx = bool(cfg.pop("TANH_APPROX", TANH_APPROX))
    if window is not None and not every_block_sees_keys(n_q, n_kv, *window, cfg["CONSUMERS"] * cfg["BLOCK_M"]):
        # a program without a key tile would wait for one forever (``supports`` refuses these)
        raise ValueError(f"window {window}: some block of {cfg['CONSUMERS'] * cfg['BLOCK_M']} queries sees "
                         f"no key of {n_kv}; the Triton forward computes it")
    regs, options = launch_options(cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(n_q, cfg["CONSUMERS"] * bm), heads, batch)
    attn_fwd_sm90[grid](descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), descriptor(o, bm),
                         lse2, heads, n_q, n_kv, qk_scale(scale), heads // k.shape[1],
                         *(window or (0, 0)), shift, float(softcap), *slope_args(alibi_slopes, lse2),
                         int(seed), float(dropout_p), HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, STAGES=cfg["STAGES"],
                         IS_CAUSAL=bool(is_causal), PINGPONG=bool(cfg["PINGPONG"]),
                         CONSUMERS=cfg["CONSUMERS"], EXP2_FMA=cfg["EXP2_FMA"], WINDOW=window is not None,
                         SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None, TANH_APPROX=tanh_approx,
                         DROPOUT=DROP_TILE if dropout_p > 0 else 0, TRIM=bool(cfg["TRIM"]), **regs, **options)
    return o, lse2
