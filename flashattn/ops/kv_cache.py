"""The KV-cache step around ``flashattn.decode``: rotary embedding of the new tokens, and their keys
and values written into the cache in place, as FlashAttention's ``flash_attn_with_kvcache`` does;
the paged cache's checks (a ``block_table`` naming each sequence's pages), and those of the left
padding (``cache_leftpad``) and of the cache rows (``cache_batch_idx``).

Both are a few elementwise operations and one indexed write per step, on the GPU, with every
index computed there from ``cache_seqlens``: nothing is read on the host, so a step that appends
can still be captured in a CUDA graph (``decode``'s ``max_seqlen``).
"""
import torch

from ..kernels.decode import HOST


def check_new(q, k_cache, k_new, v_new, paged=False):
    """Raise a TypeError or ValueError naming ``k_new`` or ``v_new`` unless both are given (or
    neither) as ``(B, H_kv, N_q, D)`` tensors like the caches' (paged or not). Returns whether
    they were given."""
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} was given without {missing}: append both or neither")
    if k_new is None:
        return False
    if paged:
        batch, (kv_heads, head_dim) = q.shape[0], k_cache.shape[2:]
    else:  # q's batch: with cache_batch_idx the cache may have more rows
        batch, (kv_heads, _, head_dim) = q.shape[0], k_cache.shape[1:]
    expected = (batch, kv_heads, q.shape[2], head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected {k_cache.dtype}, like the caches")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}; expected {k_cache.device}, like the caches")
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (B, H_kv, N_q, D) = "
                             f"{expected}: one key and value per new token (q has N_q = {q.shape[2]})")
    return True


def check_rotary(q, rotary_cos, rotary_sin, rotary_interleaved):
    """Raise naming the argument unless ``rotary_cos`` and ``rotary_sin`` are both None or both
    ``(max_positions, rotary_dim / 2)`` tensors with an even ``rotary_dim`` up to the head dim."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if rotary_cos is None:
        return False
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-dim tensor (max_positions, rotary_dim / 2)")
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor on {q.device}, like q")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)} and rotary_sin "
                         f"{tuple(rotary_sin.shape)}; they must be equal")
    if not 1 <= 2 * rotary_cos.shape[1] <= q.shape[3]:
        raise ValueError(f"rotary_cos has {rotary_cos.shape[1]} columns: rotary_dim = "
                         f"{2 * rotary_cos.shape[1]} must be from 2 to the head dim {q.shape[3]}")
    return True


def positions(cache_seqlens, n_new, device):
    """``(B, n_new)`` int64: the cache position of each new token, after the ``cache_seqlens``
    tokens already cached."""
    start = cache_seqlens.to(device=device, dtype=torch.int64, non_blocking=True)
    return start[:, None] + torch.arange(n_new, device=device)


def rotate(x, pos, rotary_cos, rotary_sin, interleaved):
    """Rotary embedding of ``x`` ``(B, H, N, D)`` at positions ``pos`` ``(B, N)``: the first
    ``rotary_dim`` features, in pairs, turned by the angle of their position; the rest unchanged.
    Pairs are ``(i, i + rotary_dim / 2)`` (GPT-NeoX's layout) or, ``interleaved``, ``(2i, 2i + 1)``
    (GPT-J's). Computed in float32, returned in x's dtype. Positions past the tables are clamped
    to the last row, so that nothing outside them is read (decode refuses tables shorter than its
    lengths, or than max_seqlen, before it gets here)."""
    half = rotary_cos.shape[1]
    pos = pos.clamp(0, rotary_cos.shape[0] - 1)
    cos = rotary_cos[pos].float()[:, None]  # (B, 1, N, half)
    sin = rotary_sin[pos].float()[:, None]
    turned, kept = x[..., :2 * half].float(), x[..., 2 * half:]
    if interleaved:
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
    else:
        x1, x2 = turned[..., :half], turned[..., half:]
    r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    out = torch.stack((r1, r2), dim=-1).flatten(-2) if interleaved else torch.cat((r1, r2), dim=-1)
    return torch.cat((out.to(x.dtype), kept), dim=-1)


def append(k_cache, v_cache, k_new, v_new, pos, cache_batch_idx=None):
    """Write the new tokens' keys and values into the caches in place, at ``pos`` ``(B, N_new)``,
    clamped into the cache (an unchecked length overwrites the cache's last entries, never memory
    outside it); sequence ``b`` into cache row ``cache_batch_idx[b]`` (clamped into the cache), or
    ``b``."""
    pos = pos.clamp(0, k_cache.shape[2] - 1)
    if cache_batch_idx is None:
        batch = torch.arange(k_cache.shape[0], device=k_cache.device)[:, None]
    else:
        batch = cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)[:, None]
    # k_cache[batch, :, pos] is (B, N_new, H_kv, D): advanced indices first, then the sliced heads
    k_cache[batch, :, pos] = k_new.transpose(1, 2)
    v_cache[batch, :, pos] = v_new.transpose(1, 2)


#: The block table's dtype, as FlashAttention's.
BLOCK_TABLE_DTYPE = torch.int32
#: A page holds a multiple of 16 keys: the kernel's smallest key tile (16 keys, on the interpreter and
#: in IEEE float32) then never spans two pages, and larger tiles span whole pages.
PAGE_MULTIPLE = 16


def check_paged(q, k_cache, block_table, batch=None, name="k_cache"):
    """Raise a TypeError or ValueError naming the argument unless ``block_table`` is a 2-D int32
    tensor ``(B, max_blocks)`` on q's device and the caches are paged, ``(num_pages, page_size,
    H_kv, D)`` with a page size that is a multiple of 16 (the caches' other checks are the
    caller's). ``B`` is q's batch unless ``batch`` says otherwise (varlen_attention's sequences);
    ``name`` is the cache's argument."""
    batch = q.shape[0] if batch is None else batch
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor of int32 or None, got {type(block_table).__name__}")
    if block_table.dtype != BLOCK_TABLE_DTYPE:
        raise TypeError(f"block_table has dtype {block_table.dtype}; expected torch.int32")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}; it is read by "
                         "the kernel, on q's device")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected (B, max_blocks) = "
                         f"({batch}, >= 1): one row of page indices per sequence")
    if k_cache.dim() != 4 or k_cache.shape[0] == 0:
        raise ValueError(f"{name} has shape {tuple(k_cache.shape)}: with block_table the caches are paged, "
                         "(num_pages, page_size, H_kv, D), with at least one page")
    page_size = k_cache.shape[1]
    if page_size == 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"{name} has shape {tuple(k_cache.shape)}: with block_table the caches are paged, "
                         f"(num_pages, page_size, H_kv, D), and page_size = {page_size} must be a positive "
                         f"multiple of {PAGE_MULTIPLE} (a contiguous cache takes no block_table)")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table has strides {block_table.stride()}; each row must be contiguous "
                         "(pass block_table.contiguous())")


def check_pages(block_table, page_size, n_pages, lengths):
    """Raise a ValueError naming ``block_table`` unless every page that the sequences of ``lengths``
    (on the host, the lengths attention runs over) use is one of the cache's ``n_pages``: checked
    only where the table is on the host already (on a GPU, reading it would wait for the GPU at
    every call; there the kernel and the append clamp each index into the cache instead)."""
    if not block_table.is_cpu:
        return
    blocks = (lengths.cpu().to(torch.int64) + page_size - 1) // page_size  # the pages each sequence uses
    used = torch.arange(block_table.shape[1]) < blocks[:, None]
    bad = (used & ((block_table < 0) | (block_table >= n_pages))).nonzero()
    if bad.numel():
        b, i = bad[0].tolist()
        raise ValueError(f"block_table[{b}, {i}] is {block_table[b, i].item()}, but the caches have "
                         f"{n_pages} pages: a page index must be from 0 to {n_pages - 1}")


def append_paged(k_cache, v_cache, k_new, v_new, pos, block_table):
    """:func:`append` into paged caches ``(num_pages, page_size, H_kv, D)``: the token at position
    ``p`` of sequence ``b`` goes to row ``p % page_size`` of page ``block_table[b, p // page_size]``.
    Positions and page indices are clamped into the table and the cache (nothing outside them is
    written, whatever an unchecked length or index holds)."""
    page_size = k_cache.shape[1]
    pos = pos.clamp(0, block_table.shape[1] * page_size - 1)
    pages = block_table.gather(1, pos // page_size).long().clamp(0, k_cache.shape[0] - 1)  # (B, N_new)
    rows = pos % page_size
    # k_cache[pages, rows] is (B, N_new, H_kv, D)
    k_cache[pages, rows] = k_new.transpose(1, 2)
    v_cache[pages, rows] = v_new.transpose(1, 2)


#: The dtypes of cache_leftpad and cache_batch_idx (FlashAttention takes int32).
INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensors(q, k_cache, cache_leftpad, cache_batch_idx, block_table):
    """Raise a TypeError or ValueError naming the argument unless ``cache_leftpad`` and
    ``cache_batch_idx`` are each None or an int32/int64 tensor ``(B,)`` on q's device or the CPU,
    and ``cache_batch_idx`` comes without ``block_table``."""
    batch = q.shape[0]
    for name, t in (("cache_leftpad", cache_leftpad), ("cache_batch_idx", cache_batch_idx)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, or None; got {type(t).__name__}")
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
        if t.shape != (batch,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({batch},), one entry per "
                             "sequence of q")
        if t.device not in (q.device, torch.device("cpu")):
            raise ValueError(f"{name} is on {t.device}; expected {q.device} (like q) or the CPU")
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx and block_table were both given: with a paged cache each "
                         "sequence's row of block_table already names its pages (reorder the table's "
                         "rows instead)")


def on_device(tensor, host, device):
    """``tensor`` (whose values ``host`` holds on the CPU) on ``device``, contiguous: copied from
    the host without waiting for the GPU's queued work (from pageable memory, CUDA stages the few
    bytes before the call returns; see ``kernels.decode.HOST``), or the tensor itself."""
    if tensor.is_cpu and device.type == "cuda":
        host = host.contiguous()
        if HOST["lengths"] == "pinned":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)
    return tensor.contiguous()


def index_tensors(plan, cache_leftpad, cache_batch_idx, cache_seqlens, max_seqlen):
    """``cache_leftpad`` and ``cache_batch_idx`` as ``Plan.run`` takes them (a dict), on the device.
    With ``max_seqlen`` they must be on q's device already and are not read on the host (the
    kernel clamps them into the cache); without, their values are checked on the host, against
    ``cache_seqlens`` (the tokens cached before the step) and the cache's rows."""
    given = dict(cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx)
    if cache_leftpad is None and cache_batch_idx is None:
        return given
    if max_seqlen is not None:
        for name, t in given.items():
            if t is not None and t.device != plan.device:
                raise ValueError(f"with max_seqlen, {name} must be on {plan.device} like q (it is read "
                                 f"there only, never copied); it is on {t.device}")
        return {name: None if t is None else t.contiguous() for name, t in given.items()}
    if cache_leftpad is not None:
        pad = cache_leftpad if cache_leftpad.is_cpu else cache_leftpad.cpu()
        ends = cache_seqlens.cpu().to(torch.int64)
        bad = ((pad < 0) | (pad > ends)).nonzero()
        if bad.numel():
            b = bad[0, 0].item()
            raise ValueError(f"cache_leftpad[{b}] is {pad[b].item()}; each must be from 0 to the sequence's "
                             f"cache_seqlens, here {ends[b].item()} (the index of its first valid key)")
        given["cache_leftpad"] = on_device(cache_leftpad, pad, plan.device)
    if cache_batch_idx is not None:
        rows = cache_batch_idx if cache_batch_idx.is_cpu else cache_batch_idx.cpu()
        bad = ((rows < 0) | (rows >= plan.n_cache)).nonzero()
        if bad.numel():
            b = bad[0, 0].item()
            raise ValueError(f"cache_batch_idx[{b}] is {rows[b].item()}, but the caches have {plan.n_cache} "
                             f"rows (dim 0): each index must be from 0 to {plan.n_cache - 1}")
        given["cache_batch_idx"] = on_device(cache_batch_idx, rows, plan.device)
    return given
