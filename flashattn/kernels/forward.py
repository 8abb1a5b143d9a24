"""The FlashAttention forward kernel and its launcher.

One program computes ``BLOCK_Q`` rows of the output for one (batch, head). It keeps its tile of Q
on chip, streams the tiles of K and V past it, and folds each one into a running softmax (the
online softmax of chapter 01, in base 2 as in chapter 02). Nothing of size N_q x N_kv ever
reaches memory: per query row it writes the output row and one number, the log-sum-exp, which the
backward pass uses to rebuild the probabilities.

The keys a query block visits split in two stages (chapter 03, ``tiles.kv_stage_bounds``):

1. ``[0, kv_full_end)``: whole tiles that every query of the block sees; no mask at all.
2. ``[kv_full_end, kv_end)``: tiles on the causal diagonal or past the end of the sequence; an
   element-wise mask hides the pairs that do not exist. Keys from ``kv_end`` on are never loaded.

Three variants switch on with arguments, not copies of the kernel (``flashattn.attention``'s
``enable_gqa`` and ``window_size``, and ``flashattn.ops.varlen``):

* grouped-query attention: query head ``h`` reads K/V head ``h // n_group`` in place;
* a sliding window (``WINDOW``): masked tiles at both edges of the window, whole tiles between,
  none outside (``tiles.kv_window_bounds``), so the cost grows with N * window;
* packed sequences (``VARLEN``): each program reads its (sequence, query block) from a table and
  the sequence's offset and length from ``cu_seqlens``, then works as for one sequence; with
  ``PAGED`` (chunked prefill over a paged KV cache) the keys and values of a sequence are gathered
  through its row of a block table, as decode's are.

More switch on the same way for what flashattn.attention adds to the scores
(``flashattn.kernels.mods``): SOFTCAP, ALIBI and MASK_KIND change each tile of scores
(``tiles.modified_scores``), DROPOUT drops probabilities with Philox (``tiles.dropout_keep``), and
BOTTOM_RIGHT moves every query to key position ``i + N_kv - N_q`` (the window's bounds shifted, so
the same tile ranges skip what the mask hides). With an attn_mask the tiles come from lists made
once per launch (``flashattn.kernels.masks``): the tiles that need no mask, read without it, then
those that need the mask or the positions' checks; the tiles the mask (or the causal mask, the
window) hides entirely are never loaded.

A row that sees no key under a window or a mask, or in a sequence without keys, gets the output 0
and the LSE -inf.

V may have a head dim of its own (SDPA allows it; DeepSeek's MLA has 192 for Q and K, 128 for V):
``HEAD_DIM``/``BLOCK_D`` are Q's and K's, the columns of ``S = Q K^T``; ``HEAD_DIM_V``/``BLOCK_DV``
are V's and O's, the columns of ``P V`` and of the accumulator.
"""
import torch
import triton
import triton.language as tl

from ..gpu import configs, launcher
from ..gpu.runtime import kernel_dtype
from .tiles import (dot, dot_acc, dropout_keep, kv_stage_bounds, kv_window_bounds, load_rows, load_tile,
                    modified_scores, qk_scale, score_mod_setup, sequence_of_program, store_tile)
from .mods import NO_MODS
from .traversal import window_masking


@triton.jit
def fwd_inner(acc, m_i, l_i, q,
               K, V, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_q, offs_d, offs_dv, kv_lo, kv_hi, n_kv, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_KV: tl.constexpr,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               WINDOW: tl.constexpr = False, win_left=0, win_right=0,
               n_q=0, shift=0, softcap=0.0, slope=0.0, Mask=None, stride_mq=0, stride_mk=0,
               seed=0, p_drop=0.0, drop_row0=0, drop_col0=0,
               Pages=None, n_pages=1, stride_kp=0, stride_vp=0, page_shift=0, Tiles=None,
               SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
               MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = 0,
               PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 16, LISTED: tl.constexpr = False):
    """Fold the key/value tiles ``[kv_lo, kv_hi)`` into the running state ``(acc, m_i, l_i)``.

    ``m_i`` is the running row maximum and ``l_i`` the running row sum, both in base 2 and already
    multiplied by the softmax scale; ``acc`` is the unnormalised output. With ``WINDOW`` query
    ``i`` sees only keys ``i - win_left .. i + win_right``. SOFTCAP, ALIBI and MASK_KIND change
    the scores (``tiles.modified_scores``); DROPOUT drops probabilities from ``acc`` but not from
    ``l_i`` (the softmax's denominator is that of all keys), its 1/(1-p) applied at the end.
    PAGED (a paged KV cache) reads key ``j`` from row ``p % PAGE_SIZE`` of page
    ``Pages[p // PAGE_SIZE]``, ``p = j + page_shift`` (decode's keys counted from a sequence's first
    valid one), ``stride_kp``/``stride_vp`` apart, instead of row ``j`` of K and V.
    LISTED (an attn_mask's tile lists, ``flashattn.kernels.masks``) walks the key tiles whose
    indices ``Tiles`` holds at positions ``[kv_lo, kv_hi) / BLOCK_KV`` instead of ``[kv_lo, kv_hi)``.
    """
    if PAGED:
        # The pages of the first tile's keys; each iteration reads those of the next tile, so that
        # a tile's addresses never wait on a load of the same iteration (the compiler then keeps
        # as many K and V tiles in flight as without pages).
        offs_next = kv_lo + tl.arange(0, BLOCK_KV)
        page_next = tl.load(Pages + (offs_next + page_shift) // PAGE_SIZE, mask=offs_next < n_kv, other=0)
    if LISTED:  # the first tile's index; each iteration reads the next one's, as for the pages
        tile_next = tl.load(Tiles + kv_lo // BLOCK_KV, mask=kv_lo < kv_hi, other=0)
    for kv_start in range(kv_lo, kv_hi, BLOCK_KV):
        if LISTED:
            listed = kv_start // BLOCK_KV + 1
            kv_start = tile_next * BLOCK_KV
            tile_next = tl.load(Tiles + listed, mask=listed * BLOCK_KV < kv_hi, other=0)
        kv_start = tl.multiple_of(kv_start, BLOCK_KV)  # lets the compiler prove aligned addresses
        offs_kv = kv_start + tl.arange(0, BLOCK_KV)
        if PAGED:
            # The tile's rows, gathered: each key's page from the block table (clamped, so that a
            # bad entry cannot read outside the cache), then its row within the page.
            page = tl.minimum(tl.maximum(page_next, 0), n_pages - 1).to(tl.int64)
            offs_next = offs_kv + BLOCK_KV
            page_next = tl.load(Pages + (offs_next + page_shift) // PAGE_SIZE, mask=offs_next < n_kv, other=0)
            in_page = (offs_kv + page_shift) % PAGE_SIZE
            k = load_rows(K, page * stride_kp + in_page * stride_kn, offs_kv, offs_d, stride_kd, n_kv,
                          HEAD_DIM, MASKED, HEAD_DIM < BLOCK_D)
        else:
            k = load_tile(K, offs_kv, offs_d, stride_kn, stride_kd, n_kv, HEAD_DIM,
                          MASKED, HEAD_DIM < BLOCK_D)
        s = dot(q, tl.trans(k), DOT_PRECISION)  # raw scores q.k, fp32
        if SOFTCAP or ALIBI or MASK_KIND != 0:  # scores already in base 2, scale applied
            s, _ = modified_scores(s, offs_q[:, None], offs_kv[None, :], n_q, n_kv, qk_scale, softcap,
                                   slope, shift, Mask, stride_mq, stride_mk, SOFTCAP, ALIBI, MASK_KIND)
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if MASKED:
            visible = offs_kv[None, :] < n_kv                       # keys past the end do not exist
            if IS_CAUSAL:
                visible = visible & (offs_q[:, None] >= offs_kv[None, :])
            if WINDOW:
                visible = visible & (offs_kv[None, :] >= offs_q[:, None] - win_left) \
                    & (offs_kv[None, :] <= offs_q[:, None] + win_right)
            # -inf is safe: key 0 comes first and every row sees it, so m_i is finite by the time
            # a row meets a tile where all its keys are hidden (then 2**(-inf - m_i) = 0).
            s = tl.where(visible, s, float("-inf"))
        # The scale (times log2 e) is applied to the row max and folded into one fused
        # multiply-add inside exp2, so the loop spends no extra instruction on scaling S.
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        if (MASKED and WINDOW) or MASK_KIND != 0:
            # Under a window (or a mask) a row may meet hidden keys before its first visible one:
            # while its max is still -inf, subtract 0 instead, so 2**(-inf - 0) = 0 rather than NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.exp2(s * s_scale - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)                                # rescales what came before
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, p_drop, drop_row0 + offs_q[:, None], tl.arange(0, BLOCK_KV)[None, :],
                                drop_col0 + kv_start, BLOCK_KV, DROPOUT)
            p = tl.where(keep, p, 0.0)
        if PAGED:
            v = load_rows(V, page * stride_vp + in_page * stride_vn, offs_kv, offs_dv, stride_vd, n_kv,
                          HEAD_DIM_V, MASKED, HEAD_DIM_V < BLOCK_DV)
        else:
            v = load_tile(V, offs_kv, offs_dv, stride_vn, stride_vd, n_kv, HEAD_DIM_V,
                          MASKED, HEAD_DIM_V < BLOCK_DV)
        acc = acc * alpha[:, None]
        acc = dot_acc(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_heads", "n_q", "n_kv", "win_left", "win_right", "seed"])  # one binary for every length
def attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_on, stride_od,
              n_heads, n_q, n_kv, qk_scale,
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
              DROPOUT: tl.constexpr = 0, BOTTOM_RIGHT: tl.constexpr = False,
              Pages=None, stride_pb=0, stride_kp=0, stride_vp=0, n_pages=1,
              PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 16):
    # Grid: axis 0 = query blocks, axis 1 = heads, axis 2 = batch. Programs are started in axis-0
    # order, so the blocks running side by side belong to one head and share its K and V in L2.
    # Grouped-query attention: query head ``head`` reads K/V head ``head // n_group`` in place.
    # Packed sequences (VARLEN): axis 0 walks the table ``Programs`` of (sequence, query block),
    # the batch axis is 1, and n_q counts the rows of all sequences until the table says which one.
    q_block = tl.program_id(0)
    if IS_CAUSAL and not VARLEN:  # the last query blocks visit the most keys: start them first
        q_block = tl.num_programs(0) - 1 - q_block
    head = tl.program_id(1)
    batch = tl.program_id(2)
    kv_head = head // n_group
    # 64-bit offsets: batch * stride can pass 2**31 elements for large inputs.
    Q += batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    K += batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    V += batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    O += batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    LSE += (batch.to(tl.int64) * n_heads + head) * n_q
    # Dropout's pairs are counted by (batch, head, row) and column in the whole tensors.
    drop_row0 = (batch.to(tl.int64) * n_heads + head) * n_q
    drop_col0 = 0
    if VARLEN:  # move to this program's sequence; from here on n_q and n_kv are its lengths
        q_block, q_offset, n_q, kv_offset, n_kv = sequence_of_program(Programs, CuSeqQ, CuSeqK,
                                                                      q_block)
        Q += q_offset * stride_qn
        O += q_offset * stride_on
        LSE += q_offset
        if PAGED:  # a paged KV cache: the sequence's keys are in the pages its row of the table names
            Pages += tl.load(Programs + 2 * tl.program_id(0)).to(tl.int64) * stride_pb
        else:
            K += kv_offset * stride_kn
            V += kv_offset * stride_vn
        drop_row0 += q_offset
        drop_col0 = kv_offset
    shift, win_left, win_right, slope = score_mod_setup(n_q, n_kv, win_left, win_right, batch, head,
                                                        Programs, Slopes, stride_sb, stride_sh,
                                                        ALIBI, VARLEN, BOTTOM_RIGHT)
    if MASK_KIND != 0:  # attn_mask's (batch, head) slice; a broadcast dim has stride 0
        Mask += batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh

    q_start = q_block * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)    # Q and K's head dim: S = Q K^T
    offs_dv = tl.arange(0, BLOCK_DV)  # V and O's, which may differ: O = P V
    q = load_tile(Q, offs_q, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, True, HEAD_DIM < BLOCK_D)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_DV], dtype=tl.float32)

    if MASK_KIND != 0:
        # attn_mask's tile lists (flashattn.kernels.masks): this query block's tiles that need no
        # mask at all, then those that need it (the mask's or the positions'); no other is loaded.
        Tiles = Lists + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_block * stride_lr
        n_full = tl.load(Tiles)
        n_listed = n_full + tl.load(Tiles + 1)
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, 0, n_full * BLOCK_KV, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, IS_CAUSAL, DOT_PRECISION,
                                   WINDOW, win_left, win_right, n_q=n_q, shift=shift, softcap=softcap,
                                   slope=slope, seed=seed, p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0,
                                   Tiles=Tiles + 2, SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT, LISTED=True)
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, n_full * BLOCK_KV, n_listed * BLOCK_KV, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, IS_CAUSAL, DOT_PRECISION,
                                   WINDOW, win_left, win_right, n_q=n_q, shift=shift, softcap=softcap,
                                   slope=slope, Mask=Mask, stride_mq=stride_mq, stride_mk=stride_mk, seed=seed,
                                   p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0, Tiles=Tiles + 2,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, LISTED=True)
    elif WINDOW:
        # A sliding window: masked tiles at its two edges, whole tiles between, none outside.
        kv_lo, kv_full_lo, kv_full_hi, kv_hi = kv_window_bounds(q_start, n_kv, win_left, win_right,
                                                                BLOCK_Q, BLOCK_KV)
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, kv_lo, kv_full_lo, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, False, DOT_PRECISION,
                                   True, win_left, win_right, n_q=n_q, shift=shift, softcap=softcap,
                                   slope=slope, seed=seed, p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                   Pages=Pages, n_pages=n_pages, stride_kp=stride_kp, stride_vp=stride_vp,
                                   PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, kv_full_lo, kv_full_hi, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, False, DOT_PRECISION,
                                   True, win_left, win_right, n_q=n_q, shift=shift, softcap=softcap,
                                   slope=slope, seed=seed, p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                   Pages=Pages, n_pages=n_pages, stride_kp=stride_kp, stride_vp=stride_vp,
                                   PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, kv_full_hi, kv_hi, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, False, DOT_PRECISION,
                                   True, win_left, win_right, n_q=n_q, shift=shift, softcap=softcap,
                                   slope=slope, seed=seed, p_drop=p_drop, drop_row0=drop_row0, drop_col0=drop_col0,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                   Pages=Pages, n_pages=n_pages, stride_kp=stride_kp, stride_vp=stride_vp,
                                   PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
    else:
        kv_full_end, kv_end = kv_stage_bounds(q_start, n_kv, BLOCK_Q, BLOCK_KV, IS_CAUSAL)
        # Stage 1: whole tiles every query of the block sees.
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, 0, kv_full_end, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, False, IS_CAUSAL, DOT_PRECISION,
                                   n_q=n_q, shift=shift, softcap=softcap, slope=slope, seed=seed, p_drop=p_drop,
                                   drop_row0=drop_row0, drop_col0=drop_col0,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                   Pages=Pages, n_pages=n_pages, stride_kp=stride_kp, stride_vp=stride_vp,
                                   PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
        # Stage 2: the diagonal and the ragged end, with the element-wise mask.
        acc, m_i, l_i = fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_q, offs_d, offs_dv, kv_full_end, kv_end, n_kv, qk_scale,
                                   HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_KV, True, IS_CAUSAL, DOT_PRECISION,
                                   n_q=n_q, shift=shift, softcap=softcap, slope=slope, seed=seed, p_drop=p_drop,
                                   drop_row0=drop_row0, drop_col0=drop_col0,
                                   SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT,
                                   Pages=Pages, n_pages=n_pages, stride_kp=stride_kp, stride_vp=stride_vp,
                                   PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)

    if WINDOW or VARLEN or MASK_KIND != 0:
        # A row that saw no key (outside every window, masked out, or a sequence without keys) has
        # L = 0 and acc = 0: dividing by 1 gives the output 0 and LSE = -inf + log2(1) = -inf, not NaN.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    # Divide by the softmax denominator once, at the end (chapter 01), and keep
    # LSE = M + log2(L): one number per row from which the backward rebuilds P = 2**(S' - LSE).
    if DROPOUT:  # the kept probabilities scaled by 1 / (1 - p), so that O's expectation is P V
        acc = acc / (l_i * (1.0 - p_drop))[:, None]
    else:
        acc = acc / l_i[:, None]
    # In float64 when the launcher asks for it: at large scores M + log2(L) rounded to float32
    # shifts every P the backward rebuilds from it by the same factor (see attention_forward).
    lse = m_i.to(LSE.dtype.element_ty) + tl.log2(l_i).to(LSE.dtype.element_ty)
    tl.store(LSE + offs_q, lse, mask=offs_q < n_q)
    store_tile(O, acc, offs_q, offs_dv, stride_on, stride_od, n_q, HEAD_DIM_V, HEAD_DIM_V < BLOCK_DV)


def empty_output(q, head_dim_v):
    """The output's tensor, uninitialised: O = P V has q's leading dims and v's head dim; in q's
    layout when the head dims agree, else contiguous (the operators' fake version allocates the
    same, so that torch.compile sees the real strides)."""
    if q.shape[-1] == head_dim_v:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:-1], head_dim_v))


def attention_forward(q, k, v, is_causal, scale, config=None, window_size=(-1, -1), sequences=None,
                      lse_dtype=torch.float32, mods=None, block_table=None):
    """Launch the forward kernel on (B, H, N, D) tensors of any strides.

    Returns ``(o, lse2)``: the output, typed like ``q`` and shaped like it but for the last dim,
    v's head dim (which may differ from q's and k's), and the base-2 log-sum-exp of
    the scaled scores, float32 of shape (B, H, N_q). ``config`` fixes the tile sizes (a dict such as
    ``{"BLOCK_Q": 64, "BLOCK_KV": 32}``); by default they are tuned on a GPU and fixed on the CPU.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention: query head ``h`` reads
    K/V head ``h // (H_q / H_kv)``). ``window_size = (left, right)`` limits what each query sees
    (``traversal.window_masking``). ``sequences`` (a ``flashattn.kernels.sequences.Sequences``) says that the
    tensors are packed sequences, (1, H, total, D), each attending only within itself.

    ``lse_dtype`` float64 keeps the LSE to more than float32's precision, for float32 inputs:
    at scores of +-100 a float32 LSE is off by up to 4e-6, and every P the backward rebuilds from
    it is off by the same factor, which made dV's error several times PyTorch's (whose largest P
    are exact). flashattn.attention asks for it; the backward kernels read either.

    ``mods`` (a ``flashattn.kernels.mods.ScoreMods``) adds a softcap, ALiBi, an attn_mask,
    dropout or the bottom-right alignment; None: none of them.

    ``block_table`` (with ``sequences``; an int32 ``(batch, max_blocks)`` tensor) says that ``k``
    and ``v`` are a paged KV cache ``(num_pages, page_size, H_kv, D)``: key ``j`` of sequence ``b``
    is row ``j % page_size`` of page ``block_table[b, j // page_size]`` (forward only).

    This is the Triton kernel everywhere; ``flashattn.ops.dispatch`` sends some calls on an
    H100/H200 to the Gluon kernel of ``flashattn.hopper.forward`` instead.
    """
    batch, heads, n_q, head_dim = q.shape
    paged = block_table is not None
    # a paged cache holds every sequence's keys (as many as cu_seqlens_k counts) in its pages
    n_kv = int(sequences.lengths_k.sum()) if paged else k.shape[2]
    kv_heads, head_dim_v = k.shape[2 if paged else 1], v.shape[3]
    mods = mods or NO_MODS
    causal, window, win_left, win_right = window_masking(
        is_causal, window_size, n_q + n_kv, mods.aligned_bottom_right(n_q, n_kv, sequences is not None))
    out_dtype = q.dtype
    q, k, v = kernel_dtype(q, k, v)
    o = empty_output(q, head_dim_v)
    lse2 = torch.empty((batch, heads, n_q), device=q.device, dtype=lse_dtype)
    if n_q == 0:
        return o.to(out_dtype), lse2
    if n_kv == 0:  # softmax over no keys: an empty sum, like scaled_dot_product_attention
        return o.zero_().to(out_dtype), lse2.fill_(float("-inf"))

    constexprs = dict(configs.head_dims(head_dim, head_dim_v), IS_CAUSAL=causal,
                      DOT_PRECISION=configs.dot_precision(q.dtype, configs.block_d(max(head_dim, head_dim_v))),
                      WINDOW=window, VARLEN=sequences is not None)
    mod_args = mods.kernel_args(n_q, n_kv, sequences is not None)
    if mods.attn_mask is not None:  # the mask's tile lists depend on the tile: it is fixed first
        config = config or launcher.fixed_config("fwd", q.dtype, constexprs)
        mod_args.update(mods.mask_lists(n_q, n_kv, {"fwd": config}, causal, window, win_left, win_right)["fwd"])
    k_strides, v_strides = k.stride(), v.stride()
    if paged:  # (page, row within the page, head, feature) as the kernel's (-, head, row, feature)
        k_strides, v_strides = ((0, t.stride(2), t.stride(1), t.stride(3)) for t in (k, v))
        mod_args.update(Pages=block_table, stride_pb=block_table.stride(0), stride_kp=k.stride(0),
                        stride_vp=v.stride(0), n_pages=k.shape[0], PAGED=True, PAGE_SIZE=k.shape[1])
    programs = cu_seqlens_q = cu_seqlens_k = None
    if sequences is None:
        def grid(meta):
            return (triton.cdiv(n_q, meta["BLOCK_Q"]), heads, batch)
    else:  # the table of (sequence, query block) depends on the tile, so the tile is fixed first
        config = config or sequences.config("fwd", q.dtype, constexprs)
        programs = sequences.programs("q", config["BLOCK_Q"], win_left, win_right)
        cu_seqlens_q, cu_seqlens_k = sequences.cu_seqlens_q, sequences.cu_seqlens_k
        grid = (programs.shape[0], heads, 1)
        if programs.shape[0] == 0:  # every sequence empty
            return o.to(out_dtype), lse2
    launcher.launch(
        "fwd", attn_fwd, grid,
        (q, k, v, o, lse2, *q.stride(), *k_strides, *v_strides, *o.stride(),
         heads, n_q, n_kv, qk_scale(scale),
         heads // kv_heads, win_left, win_right, programs, cu_seqlens_q, cu_seqlens_k),
        dict(constexprs, **mod_args), seq_len=max(n_q, n_kv), config=config)
    return o.to(out_dtype), lse2
