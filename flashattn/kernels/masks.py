"""An ``attn_mask`` summarised per tile, so that the kernels skip what it hides (FlexAttention's
BlockMask idea, computed on the device once per launch).

Each tile of ``BLOCK_Q`` queries by ``BLOCK_KV`` keys is, for the mask alone (:func:`mask_classes`),

* ``FULL``    every pair takes part unchanged (bool True; float 0): the kernel reads no mask there;
* ``PARTIAL`` anything else (some pairs hidden, or a float bias): the kernel reads the mask;
* ``EMPTY``   every pair is hidden (bool False; float -inf): the kernel never loads the tile.

The encoding is ``traversal``'s (SKIPPED, MASKED, FULL = 0, 1, 2), so that a tile's class under the
mask and under the causal mask, the window and the sequence ends (:func:`structure_classes`, the
kernels' own rules) combine as their minimum. :func:`tile_lists` turns the combined classes into
what a kernel walks: per (batch, head, row of tiles) the FULL tiles, then the PARTIAL ones, as a
list of tile indices. A key-padding mask ``(B, 1, 1, N_kv)`` keeping the first ``L_b`` keys of
sequence ``b`` becomes, for every query block, the ``L_b // BLOCK_KV`` whole tiles read without a
mask and at most one tile with it: it costs what its kept keys cost.

Nothing here waits on the device: the classes are computed by a Triton kernel and the lists by
tensor operations, with the host knowing only the shapes, so a call can be captured in a CUDA
graph and runs as one opaque operator under torch.compile.
"""
import torch
import triton
import triton.language as tl

from ..gpu.runtime import INTERPRET, INTERPRETER_LOCK
from .traversal import FULL, MASKED as PARTIAL, SKIPPED as EMPTY, cdiv


@triton.jit
def mask_classes_kernel(Mask, Classes, n_rows, n_cols, n_col_tiles,
                         stride_mb, stride_mh, stride_mq, stride_mk, stride_cb, stride_ch, stride_cq,
                         IS_BOOL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    # Grid: (tiles of the mask's rows and columns, heads, batch), 1 where the mask broadcasts; one
    # program classifies one tile.
    row_tile, col_tile = tl.program_id(0) // n_col_tiles, tl.program_id(0) % n_col_tiles
    head, batch = tl.program_id(1), tl.program_id(2)
    Mask += batch.to(tl.int64) * stride_mb + head.to(tl.int64) * stride_mh
    rows = row_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = col_tile * BLOCK_KV + tl.arange(0, BLOCK_KV)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(Mask + rows[:, None].to(tl.int64) * stride_mq + cols[None, :].to(tl.int64) * stride_mk,
                mask=inside, other=0)
    if IS_BOOL:
        kept = x != 0
        unchanged = kept
    else:  # -inf hides a pair; NaN counts as kept, so that it reaches the output as in SDPA
        x = x.to(tl.float32)
        kept = x != float("-inf")
        unchanged = x == 0.0
    any_kept = tl.max(tl.max((inside & kept).to(tl.int32), 1), 0)
    all_unchanged = tl.min(tl.min((unchanged | ~inside).to(tl.int32), 1), 0)
    cls = tl.where(all_unchanged == 1, 2, tl.where(any_kept == 1, 1, 0))
    tl.store(Classes + batch.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch
             + row_tile.to(tl.int64) * stride_cq + col_tile, cls.to(tl.int8))


def mask_classes(mask, n_q, n_kv, block_q, block_kv):
    """The class (EMPTY, PARTIAL, FULL) of each ``block_q`` x ``block_kv`` tile of ``mask`` (the
    kernels' 4-D view: bool or float, dims of size 1 broadcast): an int8 tensor
    ``(B or 1, H or 1, query tiles or 1, key tiles or 1)``, a dim of size 1 staying 1. The mask is
    read once, in place."""
    batch, heads, rows, cols = mask.shape
    classes = torch.empty((batch, heads, cdiv(rows, block_q), cdiv(cols, block_kv)), dtype=torch.int8,
                          device=mask.device)
    is_bool = mask.dtype == torch.bool
    data = mask.view(torch.uint8) if is_bool else mask
    strides = [0 if mask.shape[d] == 1 else mask.stride(d) for d in range(4)]
    grid = (classes.shape[2] * classes.shape[3], heads, batch)
    args = (data, classes, rows, cols, classes.shape[3], *strides, *classes.stride()[:3])
    # a broadcast dim is read in tiles of 1
    tiles = dict(IS_BOOL=is_bool, BLOCK_Q=1 if rows == 1 else block_q, BLOCK_KV=1 if cols == 1 else block_kv)
    if INTERPRET:
        with INTERPRETER_LOCK:
            mask_classes_kernel[grid](*args, **tiles)
    else:  # stated, so that Triton 3.9 does not warn of its default (no float arithmetic here)
        mask_classes_kernel[grid](*args, **tiles, enable_fp_fusion=True)
    return classes


def pooled(classes, rows_per_tile, cols_per_tile):
    """Classes of tiles ``rows_per_tile`` x ``cols_per_tile`` times larger, from those of
    :func:`mask_classes`: FULL where every smaller tile is, EMPTY where every one is, else PARTIAL
    (the smaller tiles past the end count for nothing)."""
    if rows_per_tile == cols_per_tile == 1:
        return classes
    *lead, rows, cols = classes.shape
    rows2, cols2 = cdiv(rows, rows_per_tile), cdiv(cols, cols_per_tile)
    pad = (0, cols2 * cols_per_tile - cols, 0, rows2 * rows_per_tile - rows)

    def reduced(fill, reduce):
        padded = torch.nn.functional.pad(classes, pad, value=fill)
        return reduce(padded.reshape(*lead, rows2, rows_per_tile, cols2, cols_per_tile), (-3, -1))

    lowest, highest = reduced(FULL, torch.amin), reduced(EMPTY, torch.amax)
    return torch.where(lowest == FULL, FULL, torch.where(highest == EMPTY, EMPTY, PARTIAL)).to(torch.int8)


def structure_classes(n_q, n_kv, block_q, block_kv, causal, window, left, right, dkdv, device):
    """The class of each tile ``(query tiles, key tiles)`` under what the kernels mask by position:
    the sequences' ends, and the causal mask (``causal``) or a window (``window``: query ``i``
    sees keys ``i - left .. i + right``; the bounds already moved to the bottom-right alignment,
    possibly negative). FULL tiles are those a kernel may run without any mask: every pair visible,
    and no key past ``n_kv`` (forward, dQ) or no query past ``n_q`` (dK/dV: ``dkdv``); EMPTY tiles
    hold no visible pair of a query and a key that exist."""
    big = n_q + n_kv  # an unbounded side
    lo, hi = (left, right) if window else (big, 0) if causal else (big, big)
    q0 = torch.arange(0, n_q, block_q, device=device)[:, None]
    k0 = torch.arange(0, n_kv, block_kv, device=device)[None, :]
    q_last, k_last = (q0 + block_q).clamp(max=n_q) - 1, (k0 + block_kv).clamp(max=n_kv) - 1
    # query i sees keys i - lo .. i + hi: some pair of the tile is visible, or every pair is
    seen = (q_last + hi >= k0) & (q0 - lo <= k_last) & (lo + hi >= 0)
    if dkdv:  # whole query tiles (their rows are loaded unmasked); keys past n_kv do not matter
        full = (q0 + block_q <= n_q) & (q0 + block_q - 1 - lo <= k0) & (k_last <= q0 + hi)
    else:     # whole key tiles; queries past n_q do not matter
        full = (k0 + block_kv <= n_kv) & (q_last - lo <= k0) & (k0 + block_kv - 1 <= q0 + hi)
    return torch.where(full, FULL, torch.where(seen, PARTIAL, EMPTY)).to(torch.int8)


def tile_lists(classes, structure, dkdv):
    """What the kernels walk: int32 ``(B or 1, H or 1, rows, 2 + tiles)``, one row per query tile
    (forward, dQ) or key tile (``dkdv``), holding ``n_full, n_partial``, then the indices of the
    row's FULL tiles, then of its PARTIAL ones, in order (EMPTY ones after them, never read).
    ``classes`` are the mask's (:func:`mask_classes`, at the kernel's tiles), ``structure`` the
    positions' (:func:`structure_classes`)."""
    combined = torch.minimum(classes, structure)  # EMPTY < PARTIAL < FULL
    if dkdv:
        combined = combined.transpose(-2, -1)
    batch, heads, rows, _ = combined.shape
    order = torch.argsort(FULL - combined.to(torch.int32), dim=-1, stable=True)  # FULL, PARTIAL, EMPTY
    counts = torch.stack([(combined == FULL).sum(-1), (combined == PARTIAL).sum(-1)], dim=-1)
    return torch.cat([counts, order], dim=-1).to(torch.int32).contiguous()


def list_args(lists):
    """The kernels' arguments for :func:`tile_lists`' result: the tensor and its batch, head and
    row strides (0 on a broadcast dim)."""
    return dict(Lists=lists, stride_lb=0 if lists.shape[0] == 1 else lists.stride(0),
                stride_lh=0 if lists.shape[1] == 1 else lists.stride(1), stride_lr=lists.stride(2))
