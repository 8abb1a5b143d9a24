"""What ``flashattn.attention`` adds to plain attention, as the kernels take it: a softcap, ALiBi,
an ``attn_mask``, dropout and the bottom-right alignment of the causal mask and windows.

:class:`ScoreMods` holds them on the host and turns them into the kernels' arguments: the
constexpr switches (SOFTCAP, ALIBI, MASK_KIND, DROPOUT, BOTTOM_RIGHT), each off when unused so
that a call without them runs the kernel it always ran, and the run-time values. A mask or the
slopes are read in place through strides, a stride of 0 on every dim of size 1, so that a
key-padding mask ``(B, 1, 1, N_kv)`` is read as is, never expanded to ``(B, H, N_q, N_kv)``, and
:meth:`ScoreMods.mask_lists` summarises it per tile once per launch, so that the kernels skip the
tiles it hides and read it only where it does not keep every pair (``flashattn.kernels.masks``).

:func:`dropout_mask` is the debug path of dropout: the mask the kernels draw for a seed, from
the same Philox call (``tiles.dropout_keep``), so that tests can build a reference with it (the
public ops return it for a call with ``return_dropout_mask=True``).
"""
import torch
import triton
import triton.language as tl

from ..gpu.runtime import INTERPRET, INTERPRETER_LOCK
from . import masks
from .tiles import DROP_PAIR, DROP_TILE, MASK_BOOL, MASK_FLOAT, MASK_KEYS, MASK_NONE, dropout_keep
from .traversal import aligned_bounds


class ScoreMods:
    """The additions of one call: ``softcap`` (0: none), ``alibi_slopes`` (None, or a 2-D tensor
    ``(B or 1, H)``: one row per sequence for packed sequences), ``attn_mask`` (None, or a 4-D bool
    or float tensor whose dims are 1 or the full size), ``dropout_p`` with its ``seed`` (an int or
    a 0-dim integer tensor, read at the launch),
    and ``bottom_right`` (positions aligned bottom-right)."""

    def __init__(self, softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0, seed=0,
                 bottom_right=False):
        self.softcap, self.alibi_slopes, self.attn_mask = float(softcap), alibi_slopes, attn_mask
        self.dropout_p, self.seed, self.bottom_right = float(dropout_p), seed, bool(bottom_right)

    @property
    def active(self):
        """Whether anything here changes the kernels (else they run as without it)."""
        return (self.softcap > 0 or self.alibi_slopes is not None or self.attn_mask is not None
                or self.dropout_p > 0 or self.bottom_right)

    def aligned_bottom_right(self, n_q, n_kv, packed):
        """Whether the kernels must shift positions: bottom-right alignment differs from top-left
        only where the lengths differ (always possible for packed sequences)."""
        return self.bottom_right and (packed or n_q != n_kv)

    def kernel_args(self, n_q, n_kv, packed):
        """The keyword arguments of the forward and backward kernels (with an attn_mask, a launch
        adds those of :meth:`mask_lists`)."""
        args = dict(SOFTCAP=self.softcap > 0, ALIBI=self.alibi_slopes is not None,
                    MASK_KIND=MASK_NONE, DROPOUT=0,
                    BOTTOM_RIGHT=self.aligned_bottom_right(n_q, n_kv, packed))
        if self.softcap > 0:
            args["softcap"] = self.softcap
        if self.alibi_slopes is not None:
            slopes = self.alibi_slopes
            args.update(Slopes=slopes, stride_sb=_stride(slopes, 0), stride_sh=_stride(slopes, 1))
        if self.attn_mask is not None:
            mask = self.attn_mask
            if mask.dtype == torch.bool:  # the same bytes, as a type every Triton backend loads
                mask, args["MASK_KIND"] = mask.view(torch.uint8), MASK_BOOL
            else:
                args["MASK_KIND"] = MASK_FLOAT
            args.update(Mask=mask, stride_mb=_stride(mask, 0), stride_mh=_stride(mask, 1),
                        stride_mq=_stride(mask, 2), stride_mk=_stride(mask, 3))
        if self.dropout_p > 0:
            # a tile's first column is a multiple of BLOCK_KV, but where packed sequences start anywhere
            args.update(seed=int(self.seed), p_drop=self.dropout_p, DROPOUT=DROP_PAIR if packed else DROP_TILE)
        return args

    def mask_lists(self, n_q, n_kv, tiles, causal, window, win_left, win_right):
        """The attn_mask's tile lists (``flashattn.kernels.masks``) as the kernels' arguments, for
        each kernel of ``tiles`` (``{name: configuration}``, "bwd_dkdv" walking key tiles, the
        others query tiles), under the kernels' masking (``traversal.window_masking``'s result).
        The mask is read once, in tiles as small as the smallest of them; the larger ones are
        pooled from those. A mask with one row for every query (a key-padding mask) also gets
        MASK_KEYS added to its MASK_KIND: the kernels read it once per key of a tile."""
        if self.aligned_bottom_right(n_q, n_kv, False):
            win_left, win_right = aligned_bounds(win_left, win_right, n_q, n_kv)
        block_q = min(c["BLOCK_Q"] for c in tiles.values())
        block_kv = min(c["BLOCK_KV"] for c in tiles.values())
        classes = masks.mask_classes(self.attn_mask, n_q, n_kv, block_q, block_kv)
        args = {}
        for name, c in tiles.items():
            dkdv = name == "bwd_dkdv"
            structure = masks.structure_classes(n_q, n_kv, c["BLOCK_Q"], c["BLOCK_KV"], causal, window,
                                                win_left, win_right, dkdv, classes.device)
            own = masks.pooled(classes, c["BLOCK_Q"] // block_q, c["BLOCK_KV"] // block_kv)
            args[name] = masks.list_args(masks.tile_lists(own, structure, dkdv))
            if self.attn_mask.shape[2] == 1:
                args[name]["MASK_KIND"] = (MASK_BOOL if self.attn_mask.dtype == torch.bool else MASK_FLOAT) + MASK_KEYS
        return args


def _stride(t, dim):
    return 0 if t.shape[dim] == 1 else t.stride(dim)


NO_MODS = ScoreMods()


@triton.jit
def dropout_mask_kernel(Keep, Row0, Col0, Rows, Cols, n_heads, n_q, n_kv, rows_per_head,
                         seed, p_drop, BLOCK: tl.constexpr, DROPOUT: tl.constexpr):
    # One program per (batch, head, query row) and block of keys; the pair is the kernels': its row
    # head * rows_per_head + Row0[b] + i, its column Col0[b] + j (packed sequences start anywhere).
    program = tl.program_id(0).to(tl.int64)       # (batch * heads + head) * n_q + query row
    i = program % n_q
    b = program // n_q // n_heads
    head = program // n_q % n_heads
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = head * rows_per_head + tl.load(Row0 + b) + i
    keep = dropout_keep(seed, p_drop, row, cols, tl.load(Col0 + b), BLOCK, DROPOUT)
    n_valid = tl.where(i < tl.load(Rows + b), tl.load(Cols + b), 0)  # past the sequence's rows: none
    keep = keep & (cols < n_valid)
    tl.store(Keep + program * n_kv + cols, keep.to(tl.int8), mask=cols < n_kv)


def dropout_mask(shape, dropout_p, seed, device, cu_seqlens_q=None, cu_seqlens_k=None):
    """The keep-mask (bool) the kernels draw for ``seed``: True where a probability is kept.

    ``shape = (B, H, N_q, N_kv)`` for ``flashattn.attention``'s (batch, heads) layout. For packed
    sequences (``cu_seqlens_q``/``cu_seqlens_k`` given, as ``varlen_attention`` takes them) it is
    ``(batch, H, max_q, max_k)``: sequence ``b``'s mask in its top-left ``n_q x n_k`` corner,
    False past it. ``seed`` is an int or a 0-dim integer tensor (as the kernels get it).

    A pair is dropped where its 16 random bits fall below ``round(dropout_p * 2**16)``
    (``tiles.dropout_keep``), so with a probability within 2**-17 of ``dropout_p``."""
    batch, heads, n_q, n_kv = shape
    if cu_seqlens_q is None:
        row0 = torch.arange(batch, dtype=torch.int64) * heads * n_q
        col0 = torch.zeros(batch, dtype=torch.int64)
        rows, cols = torch.full((batch,), n_q), torch.full((batch,), n_kv)
        rows_per_head = n_q
    else:
        cu_q, cu_k = (c.to("cpu", torch.int64) for c in (cu_seqlens_q, cu_seqlens_k))
        row0, col0 = cu_q[:-1], cu_k[:-1]
        rows, cols = cu_q.diff(), cu_k.diff()
        rows_per_head = int(cu_q[-1])
    keep = torch.empty(shape, dtype=torch.int8, device=device)
    if keep.numel():
        block = 64
        tables = [t.to(device=device, dtype=torch.int64) for t in (row0, col0, rows, cols)]
        grid = (batch * heads * n_q, triton.cdiv(n_kv, block))
        args = (keep, *tables, heads, n_q, n_kv, rows_per_head, int(seed), float(dropout_p))
        if INTERPRET:
            with INTERPRETER_LOCK:
                dropout_mask_kernel[grid](*args, BLOCK=block, DROPOUT=DROP_PAIR)
        else:  # stated, so that Triton 3.9 does not warn of its default
            dropout_mask_kernel[grid](*args, BLOCK=block, DROPOUT=DROP_PAIR, enable_fp_fusion=True)
    return keep.bool()
