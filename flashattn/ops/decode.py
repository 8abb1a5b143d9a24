"""``flashattn.decode``: attention of new tokens against a KV cache, for generation loops.

The checks, and a plan per kind of arguments: what depends only on the arguments' shapes, dtypes,
strides and devices (their checks, the tile sizes, the compiled kernels) is worked out at their
first call and remembered, so that a decoding step, tens of microseconds on a GPU, spends little
time on the host. The kernels and their launcher are ``flashattn.kernels.decode``.
"""
import math
import numbers

import torch

from ..gpu.runtime import DEVICE, INTERPRET, RUNTIME
from ..kernels.decode import Plan
from . import kv_cache
from .attention import check_window_size
from .modifiers import check_alibi, check_softcap

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LENGTH_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535      # CUDA's limit on grid axes 1 and 2 (KV heads, batch)


#: decode's plans: (the arguments' shapes, strides, dtypes, devices, alignment) -> Plan. An entry
#: means the checks that read nothing else (``_check_tensors``) passed for such arguments.
_PLANS = {}
MAX_PLANS = 64  # a loop that changes shapes every step starts afresh now and then


def decode(q, k_cache, v_cache, cache_seqlens, scale=None, return_lse=False, *, max_seqlen=None,
           k_new=None, v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
           softcap=0.0, window_size=(-1, -1), block_table=None, alibi_slopes=None, causal=True,
           cache_leftpad=None, cache_batch_idx=None):
    """Attention of the newest ``N_q`` tokens of each sequence against its KV cache.

    Args:
        q: the new tokens' queries, ``(B, H_q, N_q, D)``; N_q is usually 1.
        k_cache, v_cache: ``(B, H_kv, N_max, D)``, any strides (a ``(B, N_max, H_kv, D)`` cache
            transposed works as is), or pages ``(num_pages, page_size, H_kv, D)`` with
            ``block_table``. ``H_q`` must be a multiple of ``H_kv``: query head ``h`` uses KV head
            ``h // (H_q / H_kv)`` (grouped-query attention, as SDPA's enable_gqa).
        cache_seqlens: integer tensor ``(B,)`` (int32 or int64) of valid lengths ``L``, from 0 to
            ``N_max``: the keys of sequence ``b`` are cache entries ``0 .. L - 1`` (from
            ``cache_leftpad`` with it). Entries at or past ``L`` are never read: they may hold
            anything, NaN included. A new token that sees no key (``L = 0``, or fewer keys than
            new tokens) gets the output 0 and the lse -inf (the empty sum, like SDPA with no keys,
            and as FlashAttention).
        scale: the factor applied to ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of each row of scaled scores.
        max_seqlen: an int at least every length, for a generation loop captured in a CUDA graph:
            ``cache_seqlens`` then stays on q's device and is never read on the host (the split of
            the cache is chosen for ``max_seqlen``), so a replay reads the lengths of its own step.
            The lengths (and ``cache_leftpad``, ``cache_batch_idx``, which must then be on q's
            device too) are not checked then: each is kept within the cache by the kernel, so
            nothing outside it is read.

        k_new, v_new: the new tokens' keys and values, ``(B, H_kv, N_q, D)``, to write into the
            caches first, in place, as ``flash_attn_with_kvcache`` does: then ``cache_seqlens``
            counts the tokens cached *before* this step (FlashAttention's convention), the new
            ones go to positions ``cache_seqlens .. cache_seqlens + N_q - 1``, and attention
            runs over ``cache_seqlens + N_q`` entries (which ``max_seqlen`` then bounds).
        rotary_cos, rotary_sin: ``(max_positions, rotary_dim / 2)`` tables of a rotary embedding
            (RoPE): q, and k_new before it is cached, are rotated at their positions in the
            cache (the first ``rotary_dim`` features of each head; the rest pass unchanged). As
            FlashAttention's: not ``causal`` and without a window, every new token of q is
            rotated at the first new token's position.
        rotary_interleaved: the features turned together: ``(i, i + rotary_dim / 2)`` when False
            (GPT-NeoX's and Llama's layout), ``(2i, 2i + 1)`` when True (GPT-J's).
        softcap: > 0 caps the scaled scores at ``softcap * tanh(S / softcap)`` (Gemma 2), as
            ``flashattn.attention``'s.
        window_size: ``(left, right)`` as ``flashattn.attention``'s, aligned bottom-right as
            decoding is: token ``t`` sees keys ``L - N_q + t - left`` to ``L - N_q + t + right``;
            -1 is unbounded; with ``causal``, ``right`` must be -1 or 0 (the causal mask already
            hides every later key). The cache before the first token's window is never read.
        block_table: a paged KV cache, as ``flash_attn_with_kvcache``'s: an int32 tensor
            ``(B, max_blocks)`` of page indices, with caches ``(num_pages, page_size, H_kv, D)``
            (any strides; ``page_size`` a multiple of 16). Key ``j`` of sequence ``b`` is row
            ``j % page_size`` of page ``block_table[b, j // page_size]``; ``N_max`` is
            ``max_blocks * page_size``, and ``k_new``/``v_new`` are written into the pages in
            place. Entries past a sequence's pages are never read. The indices in use are checked
            with the lengths (without ``max_seqlen``) where the table is on the host (the
            interpreter); on a GPU, where that would wait for it, each is clamped into the cache
            (nothing outside it is read or written, but a bad index gives rows that mean nothing).
        alibi_slopes: ``(H_q,)`` or ``(B, H_q)`` float32, as ``flashattn.attention``'s: the score of
            token ``t`` and key ``j`` gets ``-slope * |L - N_q + t - j|``.
        causal: True (the default): the new tokens are the last ``N_q`` entries of each valid
            cache, so token ``t`` sees keys ``0 .. L - N_q + t`` (aligned bottom-right, as in
            decoding and speculative decoding). False: every new token sees every valid key
            (``flash_attn_with_kvcache``'s ``causal=False``, its default; with ``N_q = 1`` both
            are the same).
        cache_leftpad: integer tensor ``(B,)`` (int32 or int64), as ``flash_attn_with_kvcache``'s:
            the index of each sequence's first valid key, for a left-padded batch decoded in
            place. Sequence ``b``'s keys are cache entries ``cache_leftpad[b] .. L - 1``; those
            before are never read (they may hold anything). Positions keep counting from the
            cache's entry 0 (``L``, ``k_new``'s slots and the rotary positions are as without
            padding), and the causal mask, windows and ALiBi, which depend only on the distance
            between a token and a key, are unchanged. From 0 to ``cache_seqlens[b]``.
        cache_batch_idx: integer tensor ``(B,)`` (int32 or int64), as ``flash_attn_with_kvcache``'s:
            the cache row that sequence ``b`` reads (and ``k_new``, ``v_new`` write), for a
            contiguous cache of any number of rows ``(B_cache, H_kv, N_max, D)``; by default row
            ``b``. With repeated rows, which sequence's new keys land there is not specified. Not
            with ``block_table`` (its rows already say where each sequence's keys are).

    Returns:
        ``out`` of shape ``(B, H_q, N_q, D)`` in q's dtype, or ``(out, lse)`` with ``lse`` of shape
        ``(B, H_q, N_q)``, float32, natural log.

    Checking the lengths reads them on the host. Pass ``cache_seqlens`` (and ``cache_leftpad``,
    ``cache_batch_idx``) on the CPU (generation loops usually know the lengths there): they are
    checked there and copied to the GPU without waiting. On the GPU, checking costs one
    synchronisation per tensor and call. Either way the values are read anew at every call, so
    that call cannot be captured in a CUDA graph (it says so); with ``max_seqlen`` nothing is read
    on the host, and it can.

    A decoding step is short (tens of microseconds on a GPU), so decode keeps its host work
    small: what depends only on the arguments' shapes, dtypes, strides and devices (their checks,
    the tile sizes, the compiled kernels) is worked out at their first call and remembered.

    decode is forward only: it has no backward. Rather than return a result that silently cuts
    the autograd graph, it raises a ValueError when gradients are enabled and an input requires
    grad. Under ``torch.no_grad()`` or ``torch.inference_mode()``, as generation runs, the same
    inputs are fine and the result does not require grad.
    """
    plan = plan_for(q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, cache_batch_idx)
    _check_call(q, k_cache, v_cache, scale, return_lse)
    mods = _check_mods(softcap, window_size, causal)
    mods.update(block_table=block_table,
                alibi_slopes=check_alibi(alibi_slopes, q, plan.batch, plan.n_heads, "q's batch"))
    if k_new is not None or v_new is not None or rotary_cos is not None or rotary_sin is not None:
        return _step(plan, q, k_cache, v_cache, cache_seqlens, scale, return_lse, max_seqlen,
                     k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, mods,
                     cache_leftpad, cache_batch_idx)
    if max_seqlen is not None:
        lengths, max_len = cache_seqlens.contiguous(), _check_max_seqlen(max_seqlen, cache_seqlens, plan)
    elif not INTERPRET and torch.cuda.is_current_stream_capturing():
        raise ValueError("flashattn.decode reads cache_seqlens on the host at every call, so it "
                         "cannot be captured in a CUDA graph (the graph would replay the lengths "
                         "of the capture): pass max_seqlen=<a bound on the lengths>, with "
                         "cache_seqlens on the GPU, to capture it")
    else:
        lengths, max_len = _lengths(cache_seqlens, plan)
        if plan.paged:
            kv_cache.check_pages(block_table, plan.page_size, plan.n_pages, cache_seqlens)
    mods.update(kv_cache.index_tensors(plan, cache_leftpad, cache_batch_idx, cache_seqlens, max_seqlen))
    out, lse = plan.run(q, k_cache, v_cache, lengths, max_len,
                        plan.scale if scale is None else float(scale), keep_lse=return_lse, **mods)
    return (out, lse.view(plan.rows)) if return_lse else out


def _check_mods(softcap, window_size, causal):
    """decode's score modifications as ``Plan.run`` takes them, or an error naming the argument."""
    softcap = check_softcap(softcap)  # both as flashattn.attention checks them
    left, right = check_window_size(window_size)
    if causal is not True and causal is not False:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and right not in (-1, 0):
        raise ValueError(f"window_size is {tuple(window_size)}: with causal=True right must be -1 or 0 "
                         "(the causal mask hides every key after a token; pass causal=False for a "
                         "window reaching past it)")
    return dict(softcap=softcap, window=left, window_right=right, causal=causal)


def _step(plan, q, k_cache, v_cache, cache_seqlens, scale, return_lse, max_seqlen,
          k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, mods, cache_leftpad, cache_batch_idx):
    """decode with the KV-cache step of ``flashattn.ops.kv_cache``: rotate, append, attend."""
    appending = kv_cache.check_new(q, k_cache, k_new, v_new, plan.paged)
    rotary = kv_cache.check_rotary(q, rotary_cos, rotary_sin, rotary_interleaved)
    if appending and torch.is_grad_enabled() and (k_new.requires_grad or v_new.requires_grad):
        raise ValueError("k_new or v_new requires grad, but decode is forward only: call it under "
                         "torch.no_grad() or torch.inference_mode()")
    n_q = plan.n_q
    if max_seqlen is not None:
        lengths = cache_seqlens + n_q if appending else cache_seqlens
        max_len = _check_max_seqlen(max_seqlen, lengths, plan)
    else:
        if not INTERPRET and torch.cuda.is_current_stream_capturing():
            raise ValueError("flashattn.decode reads cache_seqlens on the host at every call, so it "
                             "cannot be captured in a CUDA graph: pass max_seqlen=<a bound on the "
                             "lengths>, with cache_seqlens on the GPU, to capture it")
        if appending:
            host = cache_seqlens if cache_seqlens.is_cpu else cache_seqlens.cpu()
            bad = ((host < 0) | (host + n_q > plan.n_max)).nonzero()
            if bad.numel():
                b = bad[0, 0].item()
                raise ValueError(f"cache_seqlens[{b}] is {host[b].item()}; with k_new each length counts "
                                 f"the tokens cached before this step, from 0 to N_max - N_q = "
                                 f"{plan.n_max - n_q}, so that the {n_q} new tokens fit in the cache "
                                 f"(N_max = {plan.n_max}, {_n_max_is(plan)})")
            after = host + n_q
            lengths, max_len = _lengths(after, plan)
        else:
            after = cache_seqlens
            lengths, max_len = _lengths(cache_seqlens, plan)
        if plan.paged:
            kv_cache.check_pages(mods["block_table"], plan.page_size, plan.n_pages, after)
    mods.update(kv_cache.index_tensors(plan, cache_leftpad, cache_batch_idx, cache_seqlens, max_seqlen))
    if rotary and max_len > rotary_cos.shape[0]:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions but the cache reaches {max_len} "
                         "tokens: the tables need a row for every position")
    # the new tokens' positions: after the tokens cached before them
    pos = kv_cache.positions(lengths - n_q, n_q, plan.device)
    if rotary:
        # As FlashAttention: not causal and without a window, q's tokens all sit at the first one's place
        local = mods["causal"] or mods["window"] >= 0 or mods["window_right"] >= 0
        q = kv_cache.rotate(q, pos if local else pos[:, :1].expand_as(pos), rotary_cos, rotary_sin,
                            rotary_interleaved)
        if appending:
            k_new = kv_cache.rotate(k_new, pos, rotary_cos, rotary_sin, rotary_interleaved)
        plan = plan_for(q, k_cache, v_cache, cache_seqlens, mods["block_table"], cache_leftpad,
                        cache_batch_idx)  # q rotated: its own strides
    if appending and plan.paged:
        kv_cache.append_paged(k_cache, v_cache, k_new, v_new, pos, mods["block_table"])
    elif appending:
        kv_cache.append(k_cache, v_cache, k_new, v_new, pos, mods["cache_batch_idx"])
    out, lse = plan.run(q, k_cache, v_cache, lengths, max_len, plan.scale if scale is None else float(scale),
                        keep_lse=return_lse, **mods)
    return (out, lse.view(plan.rows)) if return_lse else out


def plan_for(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_leftpad=None, cache_batch_idx=None):
    """The plan for such arguments (``flashattn.kernels.decode.Plan``): remembered, or made after
    the checks that read only the tensors' types, dtypes, shapes, strides and devices."""
    key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, cache_batch_idx)
    plan = _PLANS.get(key)
    if plan is None:  # the first call with such arguments: check them, then plan
        _check_tensors(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)
        kv_cache.check_index_tensors(q, k_cache, cache_leftpad, cache_batch_idx, block_table)
        plan = Plan(q, k_cache, v_cache, block_table=block_table)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _plan_key(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_leftpad=None, cache_batch_idx=None):
    """Everything ``_check_tensors``, ``kv_cache.check_index_tensors`` and ``Plan`` read, and
    everything Triton specializes the kernels on (pointer alignment, strides), besides the length
    values (and the values and alignment of the block table, the left padding and the cache rows).
    None (never a plan's key) for arguments that are not all tensors with memory: the checks then
    run and say what is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and isinstance(cache_seqlens, torch.Tensor)
            and all(t is None or isinstance(t, torch.Tensor) for t in (block_table, cache_leftpad, cache_batch_idx))):
        return None
    table = None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                              block_table.device)
    indices = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in (cache_leftpad, cache_batch_idx))
    try:
        return (table, indices, q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16,
                k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() % 16,
                v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() % 16,
                cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device,
                torch.get_float32_matmul_precision(),  # float32's dot precision (TF32 or not)
                None if INTERPRET else torch.cuda.current_device())  # where the kernels are loaded
    except RuntimeError:  # a tensor without memory (data_ptr() refuses)
        return None


def _lengths(cache_seqlens, plan):
    """Check the length values on the host; return the lengths on the plan's device and the largest."""
    n_max = plan.n_max
    host = cache_seqlens if cache_seqlens.is_cpu else cache_seqlens.cpu()  # the one synchronisation
    count = host.numel()
    if count == 0:
        return cache_seqlens, 0
    if count <= 64:  # a few lengths: quicker as a list than through torch.aminmax
        values = host.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(x) for x in torch.aminmax(host))
    if low < 0 or high > n_max:
        bad = ((host < 0) | (host > n_max)).nonzero()[0, 0].item()
        raise ValueError(f"cache_seqlens[{bad}] is {host[bad].item()}; each length must be from 0 to "
                         f"N_max = {n_max} ({_n_max_is(plan)})")
    return kv_cache.on_device(cache_seqlens, host, plan.device), high


def _n_max_is(plan):
    return "block_table's max_blocks x page_size" if plan.paged else "the caches' dim 2"


def _check_max_seqlen(max_seqlen, cache_seqlens, plan):
    """``max_seqlen`` as an int, or a TypeError/ValueError naming it: an int from 0 to N_max, with
    ``cache_seqlens`` on the inputs' device (it is not copied, so that a CUDA graph can hold it)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
    if not 0 <= max_seqlen <= plan.n_max:
        raise ValueError(f"max_seqlen is {max_seqlen}; expected 0 to N_max = {plan.n_max} ({_n_max_is(plan)})")
    if cache_seqlens.device != plan.device:
        raise ValueError(f"with max_seqlen, cache_seqlens must be on {plan.device} like q (it is read there "
                         f"only, never copied); it is on {cache_seqlens.device}")
    return int(max_seqlen)


def _check_tensors(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None):
    """Raise TypeError or ValueError naming the argument and what was expected: the checks that
    read only the tensors' types, dtypes, shapes, strides and devices (what ``_plan_key`` holds)."""
    paged = block_table is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 "
                            "or torch.float32")
        if t.dim() != 4:
            shape = ("(B, H_q, N_q, D)" if name == "q" else
                     "(num_pages, page_size, H_kv, D) with block_table" if paged else "(B, H_kv, N_max, D)")
            raise ValueError(f"{name} must have 4 dims {shape}; got shape {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must be "
                             "on the same device")
    if q.device.type != DEVICE.type:
        where = "a CUDA GPU" if DEVICE.type == "cuda" else "the CPU (Triton's interpreter)"
        raise ValueError(f"q is on {q.device}, but flashattn runs on {where} here: pass tensors "
                         f"on {DEVICE.type} (flashattn.RUNTIME is {RUNTIME!r})")
    batch, n_heads, _, head_dim = q.shape
    if v_cache.shape[3] != k_cache.shape[3]:  # the split and merge kernels hold one head dim
        raise ValueError(f"v_cache has head dim {v_cache.shape[3]} but k_cache has {k_cache.shape[3]}: "
                         "flashattn.decode needs v's head dim equal to q's and k's (flashattn.attention "
                         "and varlen_attention take a v of its own head dim)")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has "
                         f"{tuple(k_cache.shape)}; they must be equal")
    if paged:
        kv_cache.check_paged(q, k_cache, block_table)
    elif cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch}; "
                         "they must be equal (or pass cache_batch_idx, the cache row of each sequence)")
    elif k_cache.shape[0] == 0 and batch:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}: cache_batch_idx needs at least one row")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]} but q has {head_dim}; "
                         "they must be equal")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q and the caches) is {head_dim}; expected 1 to "
                         f"{MAX_HEAD_DIM}")
    kv_heads = k_cache.shape[2 if paged else 1]
    if kv_heads == 0 or n_heads % kv_heads:
        raise ValueError(f"q has {n_heads} heads and k_cache {kv_heads}; the query heads must be "
                         "a multiple of the KV heads (each KV head serves H_q / H_kv query heads)")
    if batch > MAX_GRID_DIM or kv_heads > MAX_GRID_DIM:
        raise ValueError(f"batch {batch} and KV heads {kv_heads} must each be at most "
                         f"{MAX_GRID_DIM} (CUDA's grid limit)")
    rows = 1 if paged else 2  # the dim of a head's rows: within a page, or within a sequence
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        span = (t.shape[rows] - 1) * abs(t.stride(rows)) + (head_dim - 1) * abs(t.stride(3))
        if t.shape[rows] and span >= 2**31:
            raise ValueError(f"{name}: one ({'page' if paged else 'batch'}, head) spans 2**31 elements or "
                             f"more (strides {t.stride()}); the kernel indexes within a head in 32 bits")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor of int32 or int64, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in LENGTH_DTYPES:
        raise TypeError(f"cache_seqlens has dtype {cache_seqlens.dtype}; expected torch.int32 or "
                        "torch.int64")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}; expected "
                         f"({batch},), one length per sequence of q")
    if cache_seqlens.device not in (q.device, torch.device("cpu")):
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device}; expected {q.device} (like "
                         "q) or the CPU")


def _check_call(q, k_cache, v_cache, scale, return_lse):
    """The checks of every call: the grad mode, ``scale`` and ``return_lse``."""
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad, but decode is forward only (no backward): "
                                 "call it under torch.no_grad() or torch.inference_mode(), or pass "
                                 f"{name}.detach()")
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite positive number, got {scale}")
