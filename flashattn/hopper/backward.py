"""The backward kernel for Hopper GPUs (sm_90), written in Gluon: dK and dV, and with ``DQ`` dQ too.

``flashattn.kernels.backward.attn_bwd_dkdv`` is the kernel the course teaches: one program keeps a block
of keys and values and streams the queries past it, accumulating

    dV += P^T dO        dK += dS^T Q        with  P^T = 2**(K Q^T * scale * log2 e - LSE),
                                                   dS^T = P^T * (V dO^T - Delta)

Per query tile that is four matmuls (K Q^T, V dO^T, P^T dO, dS^T Q) and the exponentials between
them: the heavier half of the backward. This kernel schedules it the way ``flashattn.hopper``
schedules the forward:

* a *producer* warp loads each consumer's K and V once, then the tiles of Q and dO by TMA into a
  ring of ``STAGES`` shared-memory buffers (one mbarrier says a stage is full, one that both
  consumers are done with it); rows past the end of the sequence read as zeros;
* two *consumer* warpgroups own ``BLOCK_N`` keys each and share every Q/dO tile. Each issues
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` together as asynchronous wgmma, waits for S^T only,
  computes P^T while dP^T is still being multiplied, then issues ``dV += P^T dO`` with P^T from
  registers and computes dS^T while that one runs, then ``dK += dS^T Q``.

LSE and Delta are read with plain loads into a little shared memory (a row of them is only 4 bytes
per query, and TMA would need the sequence length to be a multiple of 4), and from there when
needed: the LSE starts S^T's accumulator, so that the tensor cores leave ``S^T - LSE / (scale
log2 e)`` and no row of it is held in registers across the loop. Query rows past the end get
``LSE = +inf``, so that their probabilities are exactly 0 whatever their (zero) scores: no mask is
needed there. Key rows past the end are hidden (their dS^T feeds dQ); the TMA store never writes
their dK and dV.

A softcap, ALiBi, a sliding window and the bottom-right alignment change the scores as in the
forward (``scores.modified_scores``); a softcap's accumulator starts at zero instead, since the
cap acts before the LSE is subtracted. Dropout rebuilds the forward's mask from the seed
(:func:`_dropout_keep_t`).

Without ``DQ``, dQ is left to the Triton kernel (``flashattn.kernels.backward.attn_bwd_dq``), which keeps
the gradients bit-identical from run to run (each dK/dV tile is written by one program, in a fixed
order). With ``DQ`` (Triton 3.8 and later: TMA reduce-adds), each query tile's share of
``dQ = dS K`` is computed here too, a fifth matmul, and added into a float32 accumulator by the copy
engine, in an order that varies from run to run (:func:`attention_backward`). Gluon has no
interpreter: these kernels run only where they are compiled for CUDA (``flashattn.ops.dispatch``
calls them there).

Under grouped-query attention a program walks every query head of its K/V head and sums their dK
and dV itself. ``HEAD_SPLIT`` (a configuration key) splits that walk over several programs, each
storing its sums in a slot of its own, added after the launch in float32 (as FlashAttention-2 adds
per-head dK and dV): more, shorter programs, fewer query heads' Q, dO and dQ in L2 at once.
"""
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..gpu.launcher import run
from ..kernels.tiles import DROP_TILE, dropout_keep, qk_scale
from . import forward as hopper_forward
from .forward import (HEAD_DIMS, block_layout, descriptor, mma_layout, slope_args,  # noqa: F401
                      supports, tma_load, tma_ok, tma_store)
from .scores import modified_scores

if hasattr(tma, "async_atomic_add"):  # Triton 3.8 and later
    tma_reduce_add = tma.async_atomic_add
else:  # Triton hashes every name a kernel reads, so the DQ branch's must exist where it never runs
    @gluon.jit
    def tma_reduce_add(desc, coord, src):
        gl.static_assert(False, "the fused backward needs Gluon's TMA reduce-add: Triton 3.8 or later")

#: Tile configuration per head dim: BLOCK_N keys per consumer warpgroup (two of them: a program
#: owns 2 x BLOCK_N keys), BLOCK_M queries per Q/dO tile, STAGES tiles in flight. Chosen from
#: compiling for sm_90 (tools/compile_hopper.py): the largest query tile that does not spill
#: (at head dim 128, 64 queries spill 24-64 bytes per thread, 32 none); not yet timed against
#: the alternatives (tools/hopper_check.py times them).
CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, PREFETCH=True),
    128: dict(BLOCK_M=32, BLOCK_N=64, STAGES=2, PREFETCH=True),
}
#: Registers per thread: at launch, then the consumers' and the producer's budgets (setmaxnreg).
REGISTERS = dict(launch=168, consumer=240, producer=24)


#: The same for the kernel's DQ variant (dQ too, five tile products): wgmma multiplies at least
#: 64 rows, so a query tile has 64 (each consumer takes half of dQ's columns) or 128 (half its
#: rows). Timed on an H100 (triton 3.9, bf16, N = 8192; docs/gpu-record/2026-12-06-0732-*): at head
#: dim 64, 128 queries 15 % faster than 64; a third stage no faster; at 128 one stage as fast as two.
DQ_CONFIGS = {
    64: dict(BLOCK_M=128, BLOCK_N=64, STAGES=2, PREFETCH=True),
    128: dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, PREFETCH=True),
}


#: What the DQ variant changes under a softcap, ALiBi, a window or dropout: at head dim 64 the
#: 128-query tile spills 144-770 bytes per thread with the first three, 752-968 with dropout, the
#: 64-query tile 0-24 (compiled for sm_90, Triton 3.9); at 128 no smaller tile exists (it keeps
#: 112 bytes with ALiBi, 128 with the softcap, 312 with all three, 232-280 with dropout).
MODIFIED_DQ_CONFIGS = {64: dict(BLOCK_M=64), 128: {}}


def tile_config(head_dim, overrides=None):
    """The configuration of a head dim (CONFIGS), with ``overrides``."""
    return dict(CONFIGS[head_dim], **(overrides or {}))


def dq_config(head_dim, overrides=None, modified=False):
    """The configuration of a head dim for the DQ variant (DQ_CONFIGS; MODIFIED_DQ_CONFIGS too if
    ``modified``: a softcap, ALiBi, a window or dropout), with ``overrides``."""
    cfg = dict(DQ_CONFIGS[head_dim], **(MODIFIED_DQ_CONFIGS[head_dim] if modified else {}))
    cfg.update(overrides or {})
    return cfg


def head_split(n_group):
    """The fused backward's ``HEAD_SPLIT`` where its configuration names none: a program walks two
    query heads where a K/V head has 8 or more (on an H100, 32 query heads on 4 K/V heads: 1.12-1.15x
    the walk of all 8, head dims 64 and 128, N = 4096, causal), else the whole group (groups of 4:
    0.97-1.02x with a split, within the noise; docs/performance.md)."""
    return n_group // 2 if n_group >= 8 else 1


def launch_options(cfg):
    """The register budgets a configuration is compiled with: ``(constexprs, options)``."""
    return (dict(CONSUMER_REGS=REGISTERS["consumer"], PRODUCER_REGS=REGISTERS["producer"]),
            dict(num_warps=4, maxnreg=REGISTERS["launch"]))


@gluon.jit
def _bwd_producer(desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, kv_ready,
                  ready, empty, batch, kv_head, head0, n_walk, kv_start, q_lo, n_tiles,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: each consumer's K and V once, then Q and dO tile by tile into the ring, for each
    of the ``n_walk`` query heads from ``head0`` (they read K/V head ``kv_head``) in turn."""
    for c in gl.static_range(2):
        mbarrier.expect(kv_ready.index(c), desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        tma_load(desc_k, [batch, kv_head, kv_start + c * BLOCK_N, 0],
                                        kv_ready.index(c), k_smem.index(c))
        tma_load(desc_v, [batch, kv_head, kv_start + c * BLOCK_N, 0],
                                        kv_ready.index(c), v_smem.index(c))
    for t in range(n_walk * n_tiles):  # tile j of query head head0 + g, heads one after the other
        g = t // n_tiles
        head = head0 + g
        stage = t % STAGES
        # The first round through the ring does not wait (see hopper._load_tile).
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), desc_q.block_type.nbytes + desc_do.block_type.nbytes)
        q_start = q_lo + (t - g * n_tiles) * BLOCK_M
        tma_load(desc_q, [batch, head, q_start, 0], ready.index(stage),
                                        q_smem.index(stage))
        tma_load(desc_do, [batch, head, q_start, 0], ready.index(stage),
                                        do_smem.index(stage))


@gluon.jit
def _tile_stats(LSE, Delta, Slopes, stride_sb, stride_sh, t, batch, head0, n_heads, q_lo, n_q,
                n_tiles, n_total, BLOCK_M: gl.constexpr, layout: gl.constexpr, ALIBI: gl.constexpr):
    """The LSE and Delta of tile ``t`` (tile j of query head head0 + g, in the producer's order), and with
    ALIBI that head's slope (else 0); rows past the sequence's end, and every row of a tile past the
    last, read as LSE = +inf, Delta = 0. Every load is masked to the tiles that exist: a key block
    that no query sees has none (``n_tiles`` = 0, and ``g`` is then no head's), but its prefetch of
    tile 0 still runs."""
    g = t // n_tiles
    rows = (batch.to(gl.int64) * n_heads + head0 + g) * n_q  # that head's LSE, Delta
    offs = q_lo + (t - g * n_tiles) * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    inside = (offs < n_q) & (t < n_total)
    if ALIBI:
        head = head0 + g
        slope = gl.load(Slopes + batch.to(gl.int64) * stride_sb + head.to(gl.int64) * stride_sh,
                        mask=t < n_total, other=0.0)
    else:
        slope = 0.0
    return (gl.load(LSE + rows + offs, mask=inside, other=float("inf")),
            gl.load(Delta + rows + offs, mask=inside, other=0.0), slope)


@gluon.jit
def _dropout_keep_t(seed, p_drop, rows, kv_first, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    layout: gl.constexpr, DROPOUT: gl.constexpr):
    """Which pairs of a transposed tile (``BLOCK_N`` keys from ``kv_first`` by the ``BLOCK_M``
    dropout rows ``rows``) dropout keeps, in ``layout``. Drawn in S^T's own layout, a thread would
    hold 2 pairs of each Philox call (``tiles.dropout_keep`` gives a call the pairs a thread holds
    in S's orientation), so the mask is drawn in S's orientation instead, where each thread holds
    two neighbouring keys every 8 (the columns of one call: 8 pairs per call), then transposed
    through shared memory."""
    drawn: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
    rows = gl.convert_layout(rows, gl.SliceLayout(1, drawn))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, drawn))
    keep = dropout_keep(seed, p_drop, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), kv_first, BLOCK_N, DROPOUT)
    return gl.convert_layout(gl.permute(keep.to(gl.int8), (1, 0)), layout) != 0


@gluon.jit
def _bwd_consumer(desc_dk, desc_dv, desc_dq, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                  kv_ready, ready, empty, ds_ready, done,
                  LSE, Delta, batch, slot, head0, n_walk, n_heads, kv_start, q_lo, n_q, n_kv, n_tiles, scale,
                  qk_scale, q_full_lo, q_full_hi, win_left, win_right, shift, softcap, Slopes, stride_sb,
                  stride_sh, seed, p_drop, KeyMask, stride_mkb, stride_mkk, C: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, DQ: gl.constexpr, PREFETCH: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, TANH_APPROX: gl.constexpr, DROPOUT: gl.constexpr,
                  KEY_MASK: gl.constexpr):
    """One warpgroup: dK and dV of keys ``kv_start + C * BLOCK_N`` to ``+ BLOCK_N``, summed over
    the ``n_walk`` query heads from ``head0`` and stored at head ``slot`` of desc_dk and desc_dv.
    Everything is transposed (keys along rows, queries along columns), as in
    ``backward.dkdv_inner``.

    With DQ, also this query tile's share of dQ = dS K from the program's 2 x BLOCK_N keys: both
    consumers put their dS^T in shared memory (``ds_smem``, two buffers, one per parity of the
    tile), meet at ``ds_ready``, and consumer C multiplies the whole dS by its half of K's columns
    (64-query tiles) or takes its half of dS's query rows (128-query tiles: every wgmma keeps 64
    rows), then adds the float32 result into ``desc_dq`` with a TMA reduce-add (the copy engine adds
    it in L2; nothing waits for it until the buffer is reused).

    WINDOW hides the pairs outside the sliding window in the query tiles outside ``[q_full_lo,
    q_full_hi)``; SOFTCAP and ALIBI modify the scores (``scores.modified_scores``) and the softcap
    multiplies dS^T by its factor ``1 - tanh**2``. DROPOUT rebuilds the forward's mask
    (``tiles.dropout_keep``): dV takes the kept probabilities and dP^T the kept products, both
    scaled by ``1 / (1 - p)``, while dS^T = P^T * (dP^T - Delta) keeps P^T whole. KEY_MASK hides
    the keys a key-padding mask hides (one byte per key, the same for every query): read once,
    they join the ragged end's keys, and the tiles are masked as at that end."""
    s_layout: gl.constexpr = mma_layout(BLOCK_M)      # S^T, dP^T: BLOCK_N keys x BLOCK_M queries
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM)   # dK, dV: BLOCK_N keys x head dim
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = desc_dk.dtype

    kv_first = kv_start + C * BLOCK_N
    offs_kv = kv_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    # At the ragged end, keys past n_kv read as zeros: their probabilities 2**-LSE are not 0 and
    # may overflow dS^T, which dQ multiplies by those zero keys (inf * 0 = NaN): hide them.
    ragged = kv_first + BLOCK_N > n_kv
    keys_in = offs_kv < n_kv
    if KEY_MASK:
        kept = gl.load(KeyMask + batch.to(gl.int64) * stride_mkb + offs_kv.to(gl.int64) * stride_mkk,
                       mask=keys_in, other=0)
        keys_in = keys_in & (kept != 0)
        ragged = ragged | (gl.min(keys_in.to(gl.int32), 0) == 0)
    keys_in = gl.expand_dims(keys_in, 1)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    stat_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    stats = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    mbarrier.wait(kv_ready.index(C), 0)
    k = k_smem.index(C).reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.index(C).reshape([BLOCK_N, HEAD_DIM])
    if DQ:  # consumer C's share of a tile's dQ needs both consumers' keys
        DQ_ROWS: gl.constexpr = desc_dq.block_type.shape[2]
        DQ_COLS: gl.constexpr = desc_dq.block_type.shape[3]
        SPLIT_ROWS: gl.constexpr = DQ_ROWS < BLOCK_M     # else the head dim is split
        mbarrier.wait(kv_ready.index(1 - C), 0)
        k_cols0 = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
        k_cols1 = k_smem.index(1).reshape([BLOCK_N, HEAD_DIM])
        if not SPLIT_ROWS:
            k_cols0 = k_cols0.slice(C * DQ_COLS, DQ_COLS, dim=1)
            k_cols1 = k_cols1.slice(C * DQ_COLS, DQ_COLS, dim=1)
        dq_out = dq_smem.index(C).reshape([DQ_ROWS, DQ_COLS])

    n_total = n_walk * n_tiles
    if PREFETCH:
        lse_row, delta_row, slope_next = _tile_stats(LSE, Delta, Slopes, stride_sb, stride_sh, 0, batch, head0,
                                                     n_heads, q_lo, n_q, n_tiles, n_total, BLOCK_M,
                                                     stat_layout, ALIBI)
    for t in range(n_total):  # the producer's order: tile j of query head g
        g = t // n_tiles
        stage = t % STAGES
        q_start = q_lo + (t - g * n_tiles) * BLOCK_M
        # LSE and Delta pass through shared memory: read straight into the layout of S^T's
        # columns, each thread would hold a 64-bit address per column it owns. With PREFETCH the
        # next tile's rows are loaded now and stored at its start: the load's latency (both
        # consumers at once, the tensor cores idle) hides behind this tile's products.
        if PREFETCH:
            stats.index(0).store(lse_row)
            stats.index(1).store(delta_row)
            slope = slope_next
            lse_row, delta_row, slope_next = _tile_stats(LSE, Delta, Slopes, stride_sb, stride_sh, t + 1, batch,
                                                         head0, n_heads, q_lo, n_q, n_tiles, n_total,
                                                         BLOCK_M, stat_layout, ALIBI)
        else:
            lse_now, delta_now, slope = _tile_stats(LSE, Delta, Slopes, stride_sb, stride_sh, t, batch, head0,
                                                    n_heads, q_lo, n_q, n_tiles, n_total, BLOCK_M,
                                                    stat_layout, ALIBI)
            stats.index(0).store(lse_now)
            stats.index(1).store(delta_now)
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        # S^T's accumulator starts at -LSE / qk_scale, so that the tensor cores leave
        # S^T - LSE / qk_scale: no row of the LSE stays in registers. (dP^T's starts at zero: an
        # accumulator read from registers while S^T's product runs would make ptxas wait for it.)
        # ALiBi's biases join the LSE there (the tile is built before the product, in the
        # accumulator's own registers). A softcap acts on S^T itself: the LSE is subtracted after.
        lse = stats.index(0).load(col_layout)
        offs_q = q_start + gl.arange(0, BLOCK_M, layout=col_layout)
        if SOFTCAP:
            sT = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        elif ALIBI:
            bias, _ = modified_scores(s_zero, gl.expand_dims(offs_q, 0), gl.expand_dims(offs_kv, 1), qk_scale,
                                      softcap, slope, shift, False, True, False)  # -slope |i - j| log2 e
            sT = warpgroup_mma(k, q.permute((1, 0)), (bias - gl.expand_dims(lse, 0)) / qk_scale, is_async=True)
        else:
            sT = warpgroup_mma(k, q.permute((1, 0)), s_zero - gl.expand_dims(lse / qk_scale, 0), is_async=True)
        dpT = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(1, deps=[sT])            # S^T is ready; dP^T may still run
        if SOFTCAP:  # base-2 scores, minus the LSE
            sT, dcap = modified_scores(sT, gl.expand_dims(offs_q, 0), gl.expand_dims(offs_kv, 1), qk_scale,
                                       softcap, slope, shift, SOFTCAP, ALIBI, TANH_APPROX)
            sT = sT - gl.expand_dims(lse, 0)
            scale2 = 1.0
        else:
            scale2 = qk_scale
        if WINDOW:
            if (q_start < q_full_lo) | (q_start >= q_full_hi) | ragged:  # an edge of the window
                visible = (gl.expand_dims(offs_kv, 1) >= gl.expand_dims(offs_q, 0) - win_left) \
                    & (gl.expand_dims(offs_kv, 1) <= gl.expand_dims(offs_q, 0) + win_right) & keys_in
                sT = gl.where(visible, sT, float("-inf"))
        elif IS_CAUSAL:
            if (q_start < kv_first + BLOCK_N - 1) | ragged:  # on the diagonal: hide q < kv
                visible = (gl.expand_dims(offs_q, 0) >= gl.expand_dims(offs_kv, 1)) & keys_in
                sT = gl.where(visible, sT, float("-inf"))
        elif ragged:
            sT = gl.where(keys_in, sT, float("-inf"))
        pT = gl.exp2(sT * scale2)                                          # P^T from the LSE
        if DROPOUT:  # dropout's rows: those of query head g, as in the forward
            drop_rows = (batch.to(gl.int64) * n_heads + head0 + g) * n_q + offs_q
            keepT = _dropout_keep_t(seed, p_drop, drop_rows, kv_first, BLOCK_M, BLOCK_N, s_layout, DROPOUT)
            pT_op = gl.convert_layout(gl.where(keepT, pT * (1.0 / (1.0 - p_drop)), 0.0).to(dtype), a_layout)
        else:
            pT_op = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(pT_op, do, dv, is_async=True)                   # dV += P^T dO
        if SOFTCAP:  # dS^T carries the cap's factor; keep it in place of P^T
            pT = pT * dcap
        dpT = warpgroup_mma_wait(1, deps=[dpT])          # dP^T is ready; dV may still run
        if DROPOUT:
            dpT = gl.where(keepT, dpT * (1.0 / (1.0 - p_drop)), 0.0)
        delta = stats.index(1).load(col_layout)
        dsT = pT * (dpT - gl.expand_dims(delta, 0))                        # dS^T (unscaled)
        if DQ:
            ds = ds_smem.index(t % 2)                    # [2 x BLOCK_N keys, BLOCK_M queries]
            ds_mine = ds.slice(C * BLOCK_N, BLOCK_N)
            ds_mine.store(dsT.to(dtype))
            fence_async_shared()                         # wgmma reads it next (the async proxy)
            mbarrier.arrive(ds_ready.index(t % 2))
            dk = warpgroup_mma(ds_mine, q, dk, is_async=True)              # dK += dS^T Q
            mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)             # both halves of dS^T
            ds0 = ds.slice(0, BLOCK_N)                   # dS^T of consumer 0's keys, then 1's
            ds1 = ds.slice(BLOCK_N, BLOCK_N)
            if SPLIT_ROWS:                               # this consumer's queries only
                ds0 = ds0.slice(C * DQ_ROWS, DQ_ROWS, dim=1)
                ds1 = ds1.slice(C * DQ_ROWS, DQ_ROWS, dim=1)
            dq = warpgroup_mma(ds0.permute((1, 0)), k_cols0,
                               gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=mma_layout(DQ_COLS)),
                               use_acc=False, is_async=True)               # dQ = dS K
            dq = warpgroup_mma(ds1.permute((1, 0)), k_cols1, dq, is_async=True)
            dv, dk, dq, pT_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pT_op])
            mbarrier.arrive(empty.index(stage))          # done with Q_j, dO_j
            tma.store_wait(0)                            # the last tile's reduce-add has read dq_out
            dq_out.store(dq)
            fence_async_shared()
            if SPLIT_ROWS:
                dq_at = [batch, head0 + g, q_start + C * DQ_ROWS, 0]
            else:
                dq_at = [batch, head0 + g, q_start, C * DQ_COLS]
            tma_reduce_add(desc_dq, dq_at, dq_smem.index(C))
        else:
            dsT_op = gl.convert_layout(dsT.to(dtype), a_layout)
            dk = warpgroup_mma(dsT_op, q, dk, is_async=True)               # dK += dS^T Q
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(0, deps=[dv, dk, pT_op, dsT_op])
            mbarrier.arrive(empty.index(stage))          # this consumer is done with Q_j, dO_j

    if DQ:  # the other consumer may still read this one's K for its dQ: meet before reusing it
        mbarrier.arrive(done)
        mbarrier.wait(done, 0)
    # dK carries the scale once; both leave through the K and V buffers (no longer read).
    k.store((dk * scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma_store(desc_dk, [batch, slot, kv_first, 0], k_smem.index(C))
    tma_store(desc_dv, [batch, slot, kv_first, 0], v_smem.index(C))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_q", "n_kv", "win_left", "win_right", "shift", "stride_sb", "stride_sh",
                              "seed", "stride_mkb", "stride_mkk", "head_split"])
def attn_bwd_sm90(desc_q, desc_do, desc_k, desc_v, desc_dk, desc_dv, desc_dq, LSE, Delta,
                  n_heads, n_group, n_q, n_kv, scale, qk_scale, win_left, win_right, shift, softcap,
                  Slopes, stride_sb, stride_sh, seed, p_drop, KeyMask, stride_mkb, stride_mkk, head_split,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ: gl.constexpr, PREFETCH: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WINDOW: gl.constexpr = False,
                  SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, TANH_APPROX: gl.constexpr = False,
                  DROPOUT: gl.constexpr = 0, KEY_MASK: gl.constexpr = False):
    # Grid: (key blocks, K/V heads x head_split, batch). Under grouped-query attention the K/V head
    # is read by n_group query heads: each of its head_split programs sums the shares of
    # n_group / head_split of them, in a fixed order (no atomics), into its own slot of dK and dV
    # (with head_split > 1 the launcher adds the slots). With DQ it also adds each query tile's
    # share of dQ into the float32 tensor of desc_dq.
    kv_block, slot, batch = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    kv_head = slot // head_split
    n_walk = n_group // head_split
    head0 = kv_head * n_group + (slot - kv_head * head_split) * n_walk
    kv_start = kv_block * (2 * BLOCK_N)
    # The queries that see these keys: from the diagonal on if causal (BLOCK_M divides 2 BLOCK_N,
    # so kv_start is a tile boundary), those of the window under WINDOW (tiles.q_window_bounds:
    # whole tiles in [q_full_lo, q_full_hi), the window's edges around them; key j is seen by
    # queries j - win_right .. j + win_left), else all of them.
    if WINDOW:
        q_lo = gl.maximum(kv_start - win_right, 0) // BLOCK_M * BLOCK_M
        q_hi = gl.minimum(kv_start + 2 * BLOCK_N + win_left, n_q)
        q_full_lo = gl.maximum(kv_start + 2 * BLOCK_N - 1 - win_right + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
        q_full_hi = gl.minimum(kv_start + win_left + 1, n_q) // BLOCK_M * BLOCK_M
        q_hi = gl.maximum(q_hi, q_lo)
        q_full_lo = gl.minimum(gl.maximum(q_full_lo, q_lo), q_hi)
        q_full_hi = gl.maximum(q_full_hi, q_full_lo)
    else:
        if IS_CAUSAL:
            q_lo = kv_start
        else:
            q_lo = 0
        q_hi = n_q
        q_full_lo = q_lo
        q_full_hi = n_q
    n_tiles = gl.cdiv(gl.maximum(q_hi - q_lo, 0), BLOCK_M)
    if KEY_MASK:  # a key-padding mask that hides all of this program's keys: no query tile to visit
        offs = kv_start + gl.arange(0, 2 * BLOCK_N, layout=gl.BlockedLayout([1], [32], [4], [0]))
        kept = gl.load(KeyMask + batch.to(gl.int64) * stride_mkb + offs.to(gl.int64) * stride_mkk,
                       mask=offs < n_kv, other=0)
        n_tiles = gl.where(gl.max(kept.to(gl.int32), 0) > 0, n_tiles, 0)

    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + desc_v.block_type.shape, desc_v.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # dQ's buffers: dS^T of both consumers (two, by the tile's parity), each consumer's float32
    # share of dQ on its way to the reduce-add, and the mbarriers where the consumers meet.
    ds_rows: gl.constexpr = 2 * BLOCK_N if DQ else 8
    ds_cols: gl.constexpr = BLOCK_M if DQ else 8
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ds_rows, ds_cols], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2 if DQ else 1, ds_rows, ds_cols], ds_layout)
    if DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + desc_dq.block_type.shape, desc_dq.layout)
    else:
        dq_smem = ds_smem
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(kv_ready.index(c), count=1)
        mbarrier.init(ds_ready.index(c), count=2)
    mbarrier.init(done, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    gl.warp_specialize([
        (_bwd_consumer, (desc_dk, desc_dv, desc_dq, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                         kv_ready, ready, empty, ds_ready, done,
                         LSE, Delta, batch, slot, head0, n_walk, n_heads, kv_start, q_lo, n_q, n_kv, n_tiles,
                         scale, qk_scale, q_full_lo, q_full_hi, win_left, win_right, shift, softcap, Slopes,
                         stride_sb, stride_sh, seed, p_drop, KeyMask, stride_mkb, stride_mkk,
                         C0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, DQ, PREFETCH, WINDOW, SOFTCAP, ALIBI,
                         TANH_APPROX, DROPOUT, KEY_MASK)),
        (_bwd_consumer, (desc_dk, desc_dv, desc_dq, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                         kv_ready, ready, empty, ds_ready, done,
                         LSE, Delta, batch, slot, head0, n_walk, n_heads, kv_start, q_lo, n_q, n_kv, n_tiles,
                         scale, qk_scale, q_full_lo, q_full_hi, win_left, win_right, shift, softcap, Slopes,
                         stride_sb, stride_sh, seed, p_drop, KeyMask, stride_mkb, stride_mkk,
                         C1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, DQ, PREFETCH, WINDOW, SOFTCAP, ALIBI,
                         TANH_APPROX, DROPOUT, KEY_MASK)),
        (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, kv_ready,
                         ready, empty, batch, kv_head, head0, n_walk, kv_start, q_lo, n_tiles, BLOCK_M, BLOCK_N,
                         STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def has_dq_reduce():
    """Whether this Triton's Gluon has TMA's bulk reduce-add on Hopper (``tma.async_atomic_add``,
    Triton 3.8 and later), which the kernel's DQ variant needs."""
    return hasattr(tma, "async_atomic_add")


def dq_block(block_m, head_dim):
    """The (1, 1, rows, columns) block of dQ each consumer adds per query tile of ``block_m`` rows:
    half the rows (128-row tiles) or half the head dim (64-row tiles: wgmma multiplies at least
    64 rows)."""
    return [1, 1, block_m // 2, head_dim] if block_m >= 128 else [1, 1, block_m, head_dim // 2]


def dq_descriptor(dq_accum, block_m):
    """A TMA descriptor for the float32 (B, H, N_q, D) accumulator of dQ, in the blocks of
    :func:`dq_block`."""
    block = dq_block(block_m, dq_accum.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(dq_accum, list(dq_accum.shape), list(dq_accum.stride()), block, layout)


def _launch(q, k, v, do, lse2, delta, is_causal, scale, cfg, dq_accum=None, window=None, softcap=0.0,
            alibi_slopes=None, shift=0, dropout_p=0.0, seed=0, key_mask=None):
    """One launch of attn_bwd_sm90: ``(dk, dv)``, adding dQ's shares into ``dq_accum`` if given;
    ``window``, ``softcap``, ``alibi_slopes``, ``shift``, ``dropout_p`` and ``seed`` as
    ``forward.attention_forward`` takes them; ``key_mask``, a bool key-padding mask as
    ``hopper.backward_key_mask`` returns it (True: the key takes part)."""
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    if not tma_ok(do):  # dO from autograd may be expanded or strided: TMA needs rows 16 bytes apart
        do = do.contiguous()
    n_group = heads // k.shape[1]
    split = cfg.get("HEAD_SPLIT", head_split(n_group) if dq_accum is not None else 1)
    split = math.gcd(int(split), n_group)  # each program walks n_group / split query heads
    if split > 1:  # each program's sums in a slot of its own, added below
        dk, dv = (k.new_empty(batch, k.shape[1] * split, n_kv, head_dim) for _ in range(2))
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)  # k's layout where k is dense, else contiguous
    regs, options = launch_options(cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if (2 * bn) % bm:
        raise ValueError(f"BLOCK_M ({bm}) must divide 2 x BLOCK_N ({2 * bn}): the causal query "
                         "loop starts at the program's first key")
    grid = (triton.cdiv(n_kv, 2 * bn), k.shape[1] * split, batch)
    run(attn_bwd_sm90, grid, descriptor(q, bm), descriptor(do, bm), descriptor(k, bn),
        descriptor(v, bn), descriptor(dk, bn), descriptor(dv, bn),
        None if dq_accum is None else dq_descriptor(dq_accum, bm),
        lse2.contiguous(), delta.contiguous(), heads, n_group, n_q, n_kv, scale, qk_scale(scale),
        *(window or (0, 0)), shift, float(softcap), *slope_args(alibi_slopes, lse2), int(seed), float(dropout_p),
        *key_mask_args(key_mask, lse2), split, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, STAGES=cfg["STAGES"],
        IS_CAUSAL=bool(is_causal), DQ=dq_accum is not None, PREFETCH=cfg["PREFETCH"],
        WINDOW=window is not None, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
        TANH_APPROX=bool(cfg.get("TANH_APPROX", hopper_forward.TANH_APPROX)),
        DROPOUT=DROP_TILE if dropout_p > 0 else 0, KEY_MASK=key_mask is not None,
        **regs, **options)
    if split > 1:  # PyTorch sums 16-bit floats in float32 and rounds once (as FlashAttention-2 adds
        dk, dv = (t.unflatten(1, (k.shape[1], split)).sum(2) for t in (dk, dv))  # its per-head dK, dV)
    return dk, dv


def key_mask_args(key_mask, placeholder):
    """``KeyMask, stride_mkb, stride_mkk`` for a launch: the mask's bytes with its strides over
    batch (0 where one row serves every batch) and keys, or ``placeholder`` (any tensor) and zeros."""
    if key_mask is None:
        return placeholder, 0, 0
    return (key_mask.view(torch.uint8), key_mask.stride(0) if key_mask.shape[0] > 1 else 0,
            key_mask.stride(3) if key_mask.shape[3] > 1 else 0)


def attention_backward_dkdv(q, k, v, do, lse2, delta, is_causal, scale, config=None, **mods):
    """``(dk, dv)`` for inputs ``hopper.supports`` accepts (grouped heads included), like the
    Triton dK/dV kernel:
    ``lse2`` is the forward's base-2 LSE, ``delta`` is Delta (minus the LSE's gradient, if any),
    both float32 (B, H, N_q), contiguous. ``config`` overrides entries of ``CONFIGS[head_dim]``;
    ``mods``: the forward's ``window``, ``softcap``, ``alibi_slopes``, ``shift``, ``dropout_p`` and
    ``seed`` (``forward.attention_forward``)."""
    return _launch(q, k, v, do, lse2, delta, is_causal, scale, tile_config(q.shape[-1], config), **mods)


def attention_backward(q, k, v, do, lse2, delta, is_causal, scale, config=None, **mods):
    """``(dq, dk, dv)`` from one kernel, five tile products per pair of tiles: dK and dV as
    :func:`attention_backward_dkdv`, and dQ added tile by tile into a float32 accumulator by TMA
    reduce-adds (``has_dq_reduce``), then scaled and cast to q's dtype. The additions of
    different key blocks land in an order that varies from run to run, so dQ may differ in its
    last bits between runs (``flashattn.attention(..., deterministic=True)`` keeps the Triton dQ
    kernel). ``config`` overrides entries of ``DQ_CONFIGS[head_dim]``; ``mods`` as
    :func:`attention_backward_dkdv` takes them, and ``key_mask``, a key-padding mask
    (``hopper.backward_key_mask``): its hidden keys get no probability, and the programs whose keys
    it hides all visit no query tile."""
    dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    cfg = dq_config(q.shape[-1], config, hopper_forward.is_modified(**mods))  # a key mask alone is not
    dk, dv = _launch(q, k, v, do, lse2, delta, is_causal, scale, cfg, dq_accum, **mods)
    dq = torch.empty_like(q)
    torch.mul(dq_accum, scale, out=dq)  # one pass: read float32, scale, write q's dtype
    return dq, dk, dv
