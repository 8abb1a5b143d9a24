"""The @triton.jit functions and constants the kernels share: loading and storing one tile, adding
a tile's product to a running sum, and the two stages of keys a query block visits.

A kernel sees one head of one batch element as a matrix whose rows are sequence positions and whose
columns are the head dimension. ``rows`` and ``cols`` are the row and column indices of the tile;
``stride_row``/``stride_col`` say how far apart consecutive rows and columns are in memory, so
any layout works (a (B, N, H, D) tensor viewed as (B, H, N, D) simply has ``stride_row = H*D``).

Masks cost instructions and a mask that varies along the head dimension stops the compiler from
loading 16 bytes at a time, so each tile checks only what can actually be out of range: rows near a
ragged sequence end (``CHECK_ROWS``) and padded columns when the head dim is not a power of two
(``CHECK_COLS``). Both flags are compile-time constants: the checks vanish where they are off.
"""
import math

import triton
import triton.language as tl

LN2 = math.log(2.0)  # ln 2: the LSE in base 2 times LN2 is the natural-log LSE
LOG2E = 1.0 / LN2    # log2(e) = 1 / ln 2: e**x == 2**(x * LOG2E)


def qk_scale(scale: float) -> float:
    """``scale * log2(e)``, the factor the kernels multiply raw scores by before ``exp2``, kept at
    least 2**-126, the smallest normal float32.

    A smaller factor would reach the kernels as a float32 denormal or as 0, and ``-inf * 0`` (a
    hidden score times the factor) is NaN, where scaled_dot_product_attention returns the mean of
    the values. The clamp changes no result: below 2**-126 every scaled score is under 2**-26 in
    size for any |q.k| < 2**100, so each ``exp2`` of a difference of scores rounds to exactly 1
    in float32 with the true factor and with the clamped one alike."""
    return max(scale * LOG2E, 2.0 ** -126)


@triton.jit
def load_tile(base, rows, cols, stride_row, stride_col, n_rows, n_cols,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Tile ``base[rows, cols]``; elements with ``rows >= n_rows`` or ``cols >= n_cols`` read as 0."""
    ptrs = base + rows[:, None] * stride_row + cols[None, :] * stride_col
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def load_rows(base, row_offsets, rows, cols, stride_col, n_rows, n_cols,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """:func:`load_tile` for rows that lie anywhere (the pages of a paged KV cache): row ``r`` of
    the tile starts at ``base + row_offsets[r]``; ``rows`` are the rows' indices in the sequence,
    and elements with ``rows >= n_rows`` or ``cols >= n_cols`` read as 0."""
    ptrs = base + row_offsets[:, None] + cols[None, :] * stride_col
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(base, tile, rows, cols, stride_row, stride_col, n_rows, n_cols,
               CHECK_COLS: tl.constexpr):
    """Write ``tile`` to ``base[rows, cols]`` in the pointee's dtype, skipping rows past ``n_rows``
    (always checked: a store is done once per program, so the mask costs nothing that matters)."""
    ptrs = base + rows[:, None] * stride_row + cols[None, :] * stride_col
    mask = rows[:, None] < n_rows
    if CHECK_COLS:
        mask = mask & (cols[None, :] < n_cols)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def round_tf32(x):
    """x rounded to the nearest TF32 number (10 mantissa bits; ties away from zero), x itself
    where x is not finite or would round past float32's largest number.

    A TF32 tensor core ignores the 13 low mantissa bits of what it is given, which rounds toward
    zero: up to twice the error of rounding to nearest, and always in the same direction, so in a
    long sum the errors add up instead of cancelling. Adding half a TF32 step (bit 12) before
    clearing the bits rounds to nearest."""
    r = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where((tl.abs(x) <= 3.4028234663852886e38) & (tl.abs(r) <= 3.4028234663852886e38), r, x)


@triton.jit
def split_tf32(x):
    """``(hi, lo)`` of a float32 tile, both TF32 numbers, with ``hi + lo`` within 2^-22 of x.

    ``hi`` is x rounded to TF32, so ``x - hi`` is exact in float32 and at most half a TF32 step
    (2^-11 of x); ``lo`` is that rounded to TF32 too, off by at most 2^-11 of itself. (Leaving
    the rounding of both to the tensor core, which cuts, would be off by up to 2^-20, always
    toward zero.)"""
    hi = round_tf32(x)
    same = x == hi  # where x is infinite it is its own hi, and inf - inf would be NaN
    return hi, round_tf32(tl.where(same, 0.0, x - tl.where(same, 0.0, hi)))


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` of two tiles, float32 result, multiplied as ``configs.dot_precision`` says.

    3xTF32 (``"tf32x3"``) keeps float32's accuracy on TF32 tensor cores: with ``a = a_hi + a_lo``
    and ``b = b_hi + b_lo`` (:func:`split_tf32`), ``a b = a_hi b_hi + a_hi b_lo + a_lo b_hi``
    plus ``a_lo b_lo``, at most 2^-22 of the product, which is left out. The two small products
    are summed first. (Triton's own ``input_precision="tf32x3"`` does the same rewrite inside the
    compiler, and with Triton 3.6 some of its tiles computed wrong gradients: docs/performance.md.)
    """
    if DOT_PRECISION == "tf32x3" and a.dtype == tl.float32:
        a_hi, a_lo = split_tf32(a)
        b_hi, b_lo = split_tf32(b)
        small = tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo, input_precision="tf32"), input_precision="tf32")
        return tl.dot(a_hi, b_hi, small, input_precision="tf32")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b``: how every kernel adds one tile's product to a running sum.

    On tensor cores (16-bit inputs, or TF32) ``tl.dot(a, b, acc)`` does it in one fused operation.
    In IEEE float32 ``tl.dot`` becomes a chain of fused multiply-adds that continues straight
    through ``acc``, so a sum over N keys or queries is rounded N times in a row and its error
    grows with N. Summing the tile's product from zero and then adding it rounds in two levels,
    like cuBLAS's blocked sums; 3xTF32 does the same (tests/test_compiled_sm90.py checks both in
    the compiled IR).
    """
    if DOT_PRECISION == "tf32x3" and a.dtype == tl.float32:
        return acc + dot(a, b, DOT_PRECISION)  # its last dot starts from the small products, not 0
    if DOT_PRECISION == "ieee" and a.dtype == tl.float32:
        # Triton's compiler rewrites ``acc + tl.dot(a, b)`` (a dot started from the constant 0)
        # back into ``tl.dot(a, b, acc)``. Starting from ``acc * 0.0`` instead (0 for the finite
        # sums here, but not a constant) keeps the two levels apart, for one multiply per element.
        return acc + tl.dot(a, b, acc * 0.0, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def kv_stage_bounds(q_start, n_kv, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                    IS_CAUSAL: tl.constexpr):
    """``(kv_full_end, kv_end)`` for the query block starting at ``q_start``: keys
    ``[0, kv_full_end)`` in whole tiles that need no mask, ``[kv_full_end, kv_end)`` with the mask,
    none after. The forward and the dQ kernel share it; ``flashattn.kernels.traversal.kv_ranges`` is the
    same in plain Python."""
    if IS_CAUSAL:
        kv_end = tl.minimum(q_start + BLOCK_Q, n_kv)  # query i sees keys 0..i
        kv_full_end = tl.minimum(q_start, n_kv) // BLOCK_KV * BLOCK_KV
    else:
        kv_end = n_kv
        kv_full_end = n_kv // BLOCK_KV * BLOCK_KV
    return kv_full_end, kv_end


@triton.jit
def kv_window_bounds(q_start, n_kv, win_left, win_right,
                     BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """``(kv_lo, kv_full_lo, kv_full_hi, kv_hi)`` for the query block starting at ``q_start`` under a
    sliding window, where query ``i`` sees keys ``i - win_left .. i + win_right`` (both >= 0 here:
    the launcher turns an unbounded side into a bound past every key, and causal into
    ``win_right = 0``). Keys ``[kv_lo, kv_full_lo)`` and ``[kv_full_hi, kv_hi)`` need the mask,
    ``[kv_full_lo, kv_full_hi)`` are whole tiles every query of the block sees, and the tiles
    outside ``[kv_lo, kv_hi)`` are never loaded: the cost follows the window, not N_kv.
    ``flashattn.kernels.traversal.kv_window_ranges`` is the same in plain Python."""
    # Seen by some query of the block: keys q_start - win_left .. q_start + BLOCK_Q - 1 + win_right.
    kv_lo = tl.maximum(q_start - win_left, 0) // BLOCK_KV * BLOCK_KV
    kv_hi = tl.minimum(q_start + BLOCK_Q + win_right, n_kv)
    # Seen by every query of the block: keys q_start + BLOCK_Q - 1 - win_left .. q_start + win_right.
    kv_full_lo = tl.maximum(q_start + BLOCK_Q - 1 - win_left + BLOCK_KV - 1, 0) // BLOCK_KV * BLOCK_KV
    kv_full_hi = tl.minimum(q_start + win_right + 1, n_kv) // BLOCK_KV * BLOCK_KV
    # A bound may be negative when the window is aligned bottom-right (kernels shift it by
    # N_kv - N_q): a block that sees no key then gets kv_hi <= kv_lo, made an empty range here.
    kv_hi = tl.maximum(kv_hi, kv_lo)
    kv_full_lo = tl.minimum(tl.maximum(kv_full_lo, kv_lo), kv_hi)
    kv_full_hi = tl.maximum(kv_full_hi, kv_full_lo)
    return kv_lo, kv_full_lo, kv_full_hi, kv_hi


@triton.jit
def q_window_bounds(kv_start, n_q, win_left, win_right,
                    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """``(q_lo, q_full_lo, q_full_hi, q_hi)`` for the key block starting at ``kv_start`` under a
    sliding window (the dK/dV kernel's view of :func:`kv_window_bounds`): key ``j`` is seen by
    queries ``j - win_right .. j + win_left``. Queries ``[q_full_lo, q_full_hi)`` come in whole
    blocks that see every key of the block; the two ranges around them need the mask; the rest
    are skipped. ``flashattn.kernels.traversal.q_window_ranges`` is the same in plain Python.

    It is :func:`kv_window_bounds` with the roles of queries and keys exchanged: seen from key
    ``j``, the window reaches ``win_right`` queries back and ``win_left`` forward."""
    return kv_window_bounds(kv_start, n_q, win_right, win_left, BLOCK_KV, BLOCK_Q)


@triton.jit
def sequence_of_program(Programs, CuSeqQ, CuSeqK, program):
    """Packed sequences (``flashattn.ops.varlen``): the ``program``-th entry of the offset table
    ``Programs`` (pairs ``(sequence, block)``) and that sequence's place in the packed tensors.
    Returns ``(block, q_offset, n_q, kv_offset, n_kv)``; offsets are 64-bit."""
    sequence = tl.load(Programs + 2 * program)
    block = tl.load(Programs + 2 * program + 1)
    q_offset = tl.load(CuSeqQ + sequence)
    n_q = tl.load(CuSeqQ + sequence + 1) - q_offset
    kv_offset = tl.load(CuSeqK + sequence)
    n_kv = tl.load(CuSeqK + sequence + 1) - kv_offset
    return block, q_offset.to(tl.int64), n_q, kv_offset.to(tl.int64), n_kv


# -- What flashattn.attention adds to the scores (flashattn.kernels.mods builds the arguments) ----
# Each piece is switched by a constexpr flag of the kernels (SOFTCAP, ALIBI, MASK_KIND, DROPOUT),
# off by default, so that a kernel without them compiles to what it was before they existed.

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2  # MASK_KIND: no attn_mask, a boolean one, an additive one
MASK_KEYS = 4  # added to MASK_KIND: the mask has one row for every query (a key-padding mask)


@triton.jit
def tanh(x):
    """tanh in float32 from exp2, exact to a few ulps everywhere: a large |x| gives +-1 (never NaN),
    and near 0, where ``(1 - e) / (1 + e)`` would lose the digits of a small result to the
    cancellation in ``1 - e``, an odd polynomial (Taylor to x**9; its first neglected term is below
    float32's rounding for |x| < 1/4) takes over."""
    ax = tl.abs(x)
    e = tl.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def modified_scores(s, rows, cols, n_q, n_kv, qk_scale, softcap, slope, shift,
                    Mask, stride_mq, stride_mk,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASK_KIND: tl.constexpr):
    """``(S2, dcap)``: the raw scores ``s = q.k`` of a tile turned into the base-2 scores the
    softmax takes, ``log2(e) * (softcap(scale * s) - slope * |pos(i) - j| + mask)``, and the
    factor the softcap puts on dS (``1 - tanh**2``; 1 without a softcap).

    ``rows``/``cols`` are the tile's query and key indices broadcast to the tile (``[:, None]`` and
    ``[None, :]``, or the other way round in the transposed dK/dV kernel); ``pos(i) = i + shift``
    (``shift = N_kv - N_q`` aligned bottom-right, else 0). The cap acts on the natural-log scaled
    score, as in the formula: ``qk_scale * ln 2`` is the softmax scale again. A boolean mask hides
    a pair with -inf; an additive one is read as float32 and added before the conversion to base 2.
    Pairs outside the sequences read no mask (the kernels hide them anyway). A mask with one row
    for every query (MASK_KEYS) is read once per key of the tile, not once per pair."""
    if SOFTCAP:
        t = tanh(s * (qk_scale * 0.6931471805599453 / softcap))
        s2 = t * (softcap * 1.4426950408889634)
        dcap = 1.0 - t * t
    else:
        s2 = s * qk_scale
        dcap = 1.0
    if ALIBI:
        s2 = s2 - (slope * 1.4426950408889634) * tl.abs(rows + shift - cols).to(tl.float32)
    if MASK_KIND != 0:
        if MASK_KIND & 4:  # one row for every query: read as a row (or column) of keys, broadcast
            ptrs = Mask + cols.to(tl.int64) * stride_mk
            inside = cols < n_kv
        else:
            ptrs = Mask + rows.to(tl.int64) * stride_mq + cols.to(tl.int64) * stride_mk
            inside = (rows < n_q) & (cols < n_kv)
        if MASK_KIND & 1:
            keep = tl.load(ptrs, mask=inside, other=0)
            s2 = tl.where(keep != 0, s2, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
            s2 = s2 + bias * 1.4426950408889634
    return s2, dcap


#: DROPOUT: how the kernels find a pair's bits (0: no dropout). Both give every pair the same bits.
DROP_TILE = 1  # the tile's first column is a multiple of 32 (whenever BLOCK_KV is): offsets in the tile
DROP_PAIR = 2  # columns start anywhere (packed sequences): each pair's column in full


@triton.jit
def dropout_threshold(p_drop):
    """Dropout compares 16 random bits per pair with ``round(p_drop * 2**16)``: a pair is dropped
    with a probability within 2**-17 of ``p_drop`` (the kept ones are still scaled by
    ``1 / (1 - p_drop)``)."""
    return tl.cast(p_drop * 65536.0 + 0.5, tl.int32)


@triton.jit
def dropout_keep(seed, p_drop, rows, cols, col0, BLOCK_KV: tl.constexpr, DROPOUT: tl.constexpr):
    """Which pairs of a tile dropout keeps: True with probability ``1 - p_drop``. ``rows`` are the
    pairs' row ids (the (batch, head) slice's rows of the whole tensors), ``col0 + cols`` their
    columns, ``cols`` the offsets in a tile of ``BLOCK_KV`` columns; the two broadcast against
    each other, either way round (the dK/dV kernel's tiles are transposed).

    One Philox call (``tl.philox``, 10 rounds) gives four 32-bit numbers: 8 pairs of 16 bits. The
    pair (r, c) takes the call of counter ``(4 * (c // 32) + c % 8 // 2, r's low and high 32 bits,
    0)``, its number ``c // 8 % 4``, bits ``16 * (c % 2)`` on. The columns of one call, ``c % 8 // 2``
    fixed within 32, are those a thread holds in a tensor core's tile of results (pairs of
    neighbours, 8 apart): computed pair by pair, the compiler runs each call once for them all.
    The forward and both backward kernels draw the same pairs, so the backward regenerates the
    forward's mask instead of reading one: nothing N_q x N_kv is stored."""
    if DROPOUT == 1 and BLOCK_KV % 32 == 0:  # the offsets alone say where a pair sits in its call
        c = cols
    else:
        c = col0 % 32 + cols
    group = (col0 // 32 + (c >> 5)) * 4 + ((c >> 1) & 3)
    rows = rows.to(tl.int64)
    r0, r1, r2, r3 = tl.philox(seed, group.to(tl.uint32), rows.to(tl.uint32), (rows >> 32).to(tl.uint32),
                               group.to(tl.uint32) * 0)
    word = (c >> 3) & 3
    bits = tl.where(word < 2, tl.where(word == 0, r0, r1), tl.where(word == 2, r2, r3))
    bits = (bits >> ((c & 1) * 16).to(tl.uint32)) & 0xFFFF
    return bits.to(tl.int32) >= dropout_threshold(p_drop)


@triton.jit
def score_mod_setup(n_q, n_kv, win_left, win_right, batch, head, Programs, Slopes, stride_sb, stride_sh,
                    ALIBI: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """``(shift, win_left, win_right, slope)`` for one (batch, head) of one sequence: the query
    positions' shift (``N_kv - N_q`` aligned bottom-right, else 0), the window bounds moved by it
    (``traversal.aligned_bounds``), and the head's ALiBi slope (of the program's sequence under
    VARLEN: ``alibi_slopes`` may hold one row per sequence)."""
    if BOTTOM_RIGHT:
        shift = n_kv - n_q
        win_left = win_left - shift
        win_right = win_right + shift
    else:
        shift = 0
    if ALIBI:
        if VARLEN:
            row = tl.load(Programs + 2 * tl.program_id(0))  # the sequence of this program's entry
        else:
            row = batch
        slope = tl.load(Slopes + row.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh)
    else:
        slope = 0.0
    return shift, win_left, win_right, slope
