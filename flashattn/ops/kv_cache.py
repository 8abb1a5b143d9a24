"""The KV-cache step around ``flashattn.decode``: rotary embedding of the new tokens, and their keys
and values written into the cache in place, as FlashAttention's ``flash_attn_with_kvcache`` does.

Both are a few elementwise operations and one indexed write per step, on the GPU, with every
index computed there from ``cache_seqlens``: nothing is read on the host, so a step that appends
can still be captured in a CUDA graph (``decode``'s ``max_seqlen``).
"""
import torch


def check_new(q, k_cache, k_new, v_new):
    """Raise a TypeError or ValueError naming ``k_new`` or ``v_new`` unless both are given (or
    neither) as ``(B, H_kv, N_q, D)`` tensors like the caches'. Returns whether they were given."""
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} was given without {missing}: append both or neither")
    if k_new is None:
        return False
    batch, kv_heads, _, head_dim = k_cache.shape
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


def append(k_cache, v_cache, k_new, v_new, pos):
    """Write the new tokens' keys and values into the caches in place, at ``pos`` ``(B, N_new)``,
    clamped into the cache (an unchecked length overwrites the cache's last entries, never memory
    outside it)."""
    pos = pos.clamp(0, k_cache.shape[2] - 1)
    batch = torch.arange(k_cache.shape[0], device=k_cache.device)[:, None]
    # k_cache[batch, :, pos] is (B, N_new, H_kv, D): advanced indices first, then the sliced heads
    k_cache[batch, :, pos] = k_new.transpose(1, 2)
    v_cache[batch, :, pos] = v_new.transpose(1, 2)
