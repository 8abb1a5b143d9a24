"""``flashattn.varlen_attention``: a batch of sequences of different lengths, packed end to end.

Padding a batch to its longest sequence wastes work on the padding (and attention on padding must
then be masked). FlashAttention's ``flash_attn_varlen_func`` instead packs the sequences one after
another, with no padding at all, and describes the batch by the cumulative lengths:

    q: (total_q, H_q, D)      k: (total_k, H_kv, D)      v: (total_k, H_kv, D_v)
    cu_seqlens_q = [0, n_0, n_0 + n_1, ..., total_q]     (int32, batch + 1 entries)

Sequence ``b`` owns the rows ``cu_seqlens[b]:cu_seqlens[b + 1]``, and its queries see only its own
keys, aligned top-left as in :func:`flashattn.attention` (query ``i`` of a sequence, with
``is_causal``, sees that sequence's keys ``0..i``) unless ``causal_alignment="bottom_right"``.
Grouped-query attention and sliding windows work as there.

How the kernels do it: the very same forward and backward kernels as ``flashattn.attention``, with
``VARLEN`` switched on. Their launch grid walks a table of programs built here from the lengths,
one entry ``(sequence, block)`` per query block (forward, dQ) or key block (dK/dV) of every
sequence, so no program is spent on padding. The kernel reads its entry, then the sequence's offset
and length from ``cu_seqlens``, and from there on works as for one sequence. The table lists the
programs with the most work first, so that the long sequences do not finish last.

Checking ``cu_seqlens`` (non-decreasing, from 0 to the total) reads it on the host once per call.
The tile sizes are fixed before the launch (the table depends on them): the default configuration
of each kernel, not autotuned.

With ``block_table`` the keys and values are a paged KV cache, as ``flash_attn_varlen_func`` takes
it (chunked prefill: a chunk of new queries per sequence against everything cached so far): the
forward kernel gathers each sequence's keys through its row of the table, as decode does. That
call is forward only.
"""
import numbers

import torch

from ..kernels.forward import attention_forward
from ..kernels.sequences import Sequences
from . import kv_cache
from .attention import check_inputs, check_window_size
from ..kernels.mods import ScoreMods, dropout_mask
from .autograd import attention_op, natural_lse
from .modifiers import check_alibi, check_alignment, check_dropout, check_softcap, draw_seed


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False,
                     scale=None, return_lse=False, enable_gqa=False, window_size=(-1, -1), *,
                     dropout_p=0.0, causal_alignment="top_left", softcap=0.0, alibi_slopes=None,
                     return_dropout_mask=False, deterministic=False, block_table=None):
    """Attention over a batch of packed sequences of different lengths (no padding), in the layout
    of FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: ``(total_q, H_q, D)``, the queries of all sequences one after another.
        k, v: ``(total_k, H_kv, D)`` and ``(total_k, H_kv, D_v)``, the keys and values likewise
            (``H_kv = H_q`` unless ``enable_gqa``; v's head dim may differ from q's, as in
            :func:`flashattn.attention`).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64, converted) tensors of ``batch + 1`` entries on
            the inputs' device,
            the cumulative lengths: starting at 0, non-decreasing, ending at ``total_q`` (``total_k``).
            Sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``; a sequence may be empty.
        max_seqlen_q, max_seqlen_k: at least the longest query (key) sequence, as FlashAttention
            asks; checked here, not needed by the kernels.
        is_causal, scale, enable_gqa, window_size: as in :func:`flashattn.attention`, within each
            sequence (positions counted from the sequence's first row, aligned as
            ``causal_alignment`` says).
        return_lse: also return the log-sum-exp.
        dropout_p, causal_alignment, softcap: as in :func:`flashattn.attention`, within each
            sequence (aligned bottom-right, query ``i`` of a sequence of ``n_q`` queries and ``n_k``
            keys sits at key position ``i + n_k - n_q``).
        alibi_slopes: float32 ``(H_q,)`` or ``(batch, H_q)`` (one row per sequence), as in
            :func:`flashattn.attention`.
        return_dropout_mask: also return the dropout mask this call drew (a debugging aid, as in
            :func:`flashattn.attention`), bool ``(batch, H_q, max_seqlen_q, max_seqlen_k)``:
            sequence ``b``'s ``n_q x n_k`` mask in the top-left corner of its block, False past it
            (FlashAttention's ``return_attn_probs`` pads its batch likewise).
        deterministic: as in :func:`flashattn.attention` (packed sequences always take the
            Triton kernels, whose gradients are bit-identical from run to run).
        block_table: a paged KV cache, as ``flash_attn_varlen_func``'s: an int32 tensor ``(batch,
            max_blocks)`` of page indices on q's device, with ``k`` and ``v`` of shape
            ``(num_pages, page_size, H_kv, D)`` and ``(num_pages, page_size, H_kv, D_v)`` (any
            strides; ``page_size`` a multiple of 16). Key ``j`` of sequence ``b`` (of the
            ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` it has, at most ``max_blocks * page_size``)
            is row ``j % page_size`` of page ``block_table[b, j // page_size]``. The page indices
            in use are checked where the table is on the host; on a GPU each is clamped into
            the cache instead. Forward only: with gradients enabled and an input that requires
            grad it raises (call it under ``torch.no_grad()`` or ``torch.inference_mode()``).

    Returns:
        ``out`` of shape ``(total_q, H_q, D_v)`` in ``q``'s dtype, or ``(out, lse)`` with ``lse`` of shape
        ``(H_q, total_q)``, float32, natural log (FlashAttention's layout). Queries of a sequence
        with no visible key get 0 and lse -inf. Gradients flow to ``q``, ``k`` and ``v``. With
        ``return_dropout_mask``, the mask comes last.
    """
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != (4 if paged and name != "q" else 3):
            raise ValueError(f"{name} must be " + ("4-D (num_pages, page_size, heads, head_dim) with block_table"
                                                   if paged and name != "q" else
                                                   "3-D (total_tokens, heads, head_dim)") +
                             f" for varlen_attention; got shape {tuple(t.shape)}")
    # The (heads, tokens, head_dim) views have flashattn.attention's layout: its checks apply as is
    # (to the first page of a paged cache).
    views = [t[0] if paged and i and isinstance(t, torch.Tensor) and len(t) else t for i, t in enumerate((q, k, v))]
    check_inputs(*(t.transpose(0, 1) if isinstance(t, torch.Tensor) else t for t in views),
                 is_causal, scale, return_lse, enable_gqa)
    window_size = check_window_size(window_size)
    check_alignment(causal_alignment)
    for name, flag in (("return_dropout_mask", return_dropout_mask), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    lengths_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    lengths_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], q.device)
    if paged:
        _check_pages(q, k, v, block_table, lengths_k)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"cu_seqlens_q has {len(lengths_q) + 1} entries but cu_seqlens_k has "
                         f"{len(lengths_k) + 1}; both must be batch + 1 long")
    for name, bound, lengths in (("max_seqlen_q", max_seqlen_q, lengths_q),
                                 ("max_seqlen_k", max_seqlen_k, lengths_k)):
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(bound).__name__}")
        longest = max(lengths, default=0)
        if bound < longest:
            raise ValueError(f"{name} is {bound} but the longest sequence in cu_seqlens_{name[-1]} "
                             f"has {longest} tokens")

    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    sequences = Sequences(cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k)
    dropout_p, softcap = check_dropout(dropout_p), check_softcap(softcap)
    slopes = check_alibi(alibi_slopes, q, len(lengths_q), q.shape[1], "the sequences")
    mods = ScoreMods(softcap, slopes, None, dropout_p, draw_seed() if dropout_p > 0 else None,
                     causal_alignment == "bottom_right")
    # One "batch" of H heads whose rows are all sequences' tokens: views, no copies.
    if paged:
        q4 = q.transpose(0, 1).unsqueeze(0)
        out, lse2 = attention_forward(q4, k, v, is_causal, scale, None, window_size, sequences,
                                      mods=mods if mods.active else None, block_table=block_table)
    else:
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out, lse2 = attention_op(q4, k4, v4, is_causal, scale, window_size, sequences,
                                 mods if mods.active else None, deterministic)
    results = (out[0].transpose(0, 1),) + ((natural_lse(lse2[0]),) if return_lse else ())
    if return_dropout_mask:
        shape = (len(lengths_q), q.shape[1], max_seqlen_q, max_seqlen_k)
        seed = mods.seed if dropout_p else 0   # without dropout every pair is kept: p = 0
        results += (dropout_mask(shape, dropout_p, seed, q.device, cu_seqlens_q, cu_seqlens_k),)
    return results if len(results) > 1 else results[0]


def _check_pages(q, k, v, block_table, lengths_k):
    """Raise naming the argument unless ``block_table`` and the paged ``k``, ``v`` fit the
    sequences of ``lengths_k``, and no input requires grad (the paged call is forward only)."""
    kv_cache.check_paged(q, k, block_table, batch=len(lengths_k), name="k")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}: with block_table both "
                         "are (num_pages, page_size, H_kv, head_dim), the same but for the head dim")
    page_size, max_blocks = k.shape[1], block_table.shape[1]
    longest = max(lengths_k, default=0)
    if longest > max_blocks * page_size:
        b = lengths_k.index(longest)
        raise ValueError(f"cu_seqlens_k gives sequence {b} {longest} keys, but block_table holds "
                         f"{max_blocks} pages of {page_size} keys per sequence ({max_blocks * page_size} keys)")
    kv_cache.check_pages(block_table, page_size, k.shape[0], torch.tensor(lengths_k, dtype=torch.int64))
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad, but varlen_attention with block_table is forward "
                                 "only (no backward through a paged cache): call it under torch.no_grad() "
                                 f"or torch.inference_mode(), or pass {name}.detach()")


def _check_cu_seqlens(name, cu_seqlens, total, device):
    """``cu_seqlens`` as int32 and the lengths of the sequences (a list of ints), or a
    TypeError/ValueError naming ``name``. ``total`` None: any total (a paged cache's keys)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} has dtype {cu_seqlens.dtype}; expected torch.int32 (or torch.int64)")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {device}; they must be on "
                         "the same device")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries; got shape "
                         f"{tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()  # one read on the host: the checks and the launch tables need it
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0; got {bounds[0]}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if min(lengths) < 0:
        at = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing; it decreases from {bounds[at]} to "
                         f"{bounds[at + 1]} at index {at + 1}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens, {total}; got {bounds[-1]}")
    if bounds[-1] >= 2 ** 31:  # the kernels read int32 offsets (int64 ones are converted)
        raise ValueError(f"{name}: {bounds[-1]} tokens; at most 2**31 - 1 are supported")
    return lengths

