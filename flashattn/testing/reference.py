"""Plain-PyTorch references for every step the course teaches.

These are slow and simple on purpose: each one is the formula of a chapter written out, so that
the kernels (and the learners' exercises) have something trustworthy to be compared against.
Run them in float64 to get a reference that rounding cannot argue with.

All functions take tensors of shape ``(..., N, D)`` (any leading dims) and use the course's names:
S scores, P probabilities, M running max, L running sum, LSE log-sum-exp, Delta = rowsum(dO * O).
"""
import math

import torch

from ..kernels.tiles import LOG2E
from ..kernels.traversal import decode_split_bounds, kv_ranges


def default_scale(head_dim: int, scale=None) -> float:
    """``scale`` if given, else 1/sqrt(head_dim), the default of scaled_dot_product_attention."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def causal_mask(n_q: int, n_kv: int, device=None) -> torch.Tensor:
    """Boolean (n_q, n_kv) mask, True where query i may see key j, i.e. j <= i (top-left aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_kv, device=device)[None, :]
    return j <= i


def _accumulator_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def naive_attention(q, k, v, is_causal=False, scale=None, *, attn_mask=None, dropout_p=0.0,
                    enable_gqa=False, window_size=(-1, -1), causal_alignment="top_left", softcap=0.0,
                    alibi_slopes=None, dropout_keep=None):
    """Attention as the formula reads: materialise S and P (N_q x N_kv each), then O = P V.

    Computes in the dtype of the inputs. Returns ``(out, lse)``, with ``lse`` the natural-log
    log-sum-exp of each row of the scaled, masked scores, in float32 (float64 for float64 inputs).
    The keyword arguments are those of ``flashattn.attention`` (see :func:`modified_attention`);
    dropout needs the keep-mask ``dropout_keep`` the kernels drew (``flashattn.kernels.mods.dropout_mask``).
    """
    if (attn_mask is not None or dropout_p or enable_gqa or tuple(window_size) != (-1, -1)
            or causal_alignment != "top_left" or softcap or alibi_slopes is not None):
        return modified_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                  window_size=window_size, causal_alignment=causal_alignment,
                                  softcap=softcap, alibi_slopes=alibi_slopes, dropout_keep=dropout_keep)
    scale = default_scale(q.shape[-1], scale)
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(s.to(_accumulator_dtype(s.dtype)), dim=-1)
    p = torch.softmax(s, dim=-1)
    return p @ v, lse


def softmax_safe(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, subtracting the row max first so exp never overflows."""
    m = x.max(dim=-1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def merge_states(m_a, l_a, m_b, l_b):
    """Merge two partial softmax states ``(M, L)`` of disjoint pieces of the same rows.

    ``L`` is a sum of ``exp(x - M)``; each sum is moved to the common max before adding. Returns
    ``(m, l)``. Works elementwise on tensors of any shape (one entry per row).
    """
    m = torch.maximum(m_a, m_b)
    return m, l_a * torch.exp(m_a - m) + l_b * torch.exp(m_b - m)


def online_softmax_trace(x: torch.Tensor, block: int):
    """Stream the rows of ``x`` block by block, as FlashAttention does, recording the state.

    Returns a dict of tensors with one row per block (shape (n_blocks, ...rows)):
    ``M`` the running max after the block, ``L`` the running sum after the block, ``alpha`` the
    factor ``exp(M_old - M_new)`` that rescaled what came before, and ``block_max``/``block_sum``
    the max and sum of the block alone (relative to its own max).
    """
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    trace = {"M": [], "L": [], "alpha": [], "block_max": [], "block_sum": []}
    for start in range(0, x.shape[-1], block):
        xb = x[..., start:start + block]
        m_new = torch.maximum(m, xb.max(dim=-1).values)
        alpha = torch.exp(m - m_new)
        l = l * alpha + torch.exp(xb - m_new[..., None]).sum(dim=-1)
        m = m_new
        trace["M"].append(m)
        trace["L"].append(l)
        trace["alpha"].append(alpha)
        trace["block_max"].append(xb.max(dim=-1).values)
        trace["block_sum"].append(torch.exp(xb - xb.max(dim=-1, keepdim=True).values).sum(dim=-1))
    return {name: torch.stack(values) for name, values in trace.items()}


def online_softmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Softmax over the last dim from one streaming pass for M and L (block by block) and a
    final normalisation: ``exp(x - M) / L``."""
    trace = online_softmax_trace(x, block)
    m, l = trace["M"][-1], trace["L"][-1]
    return torch.exp(x - m[..., None]) / l[..., None]


def tiled_forward(q, k, v, is_causal=False, scale=None, block_q=32, block_kv=16):
    """The forward kernel's algorithm in PyTorch, loop for loop.

    For each query block: stage 1 folds in the whole key tiles that need no mask, stage 2 the
    tiles on the diagonal or past the end with the mask; the softmax runs online in base 2, and
    the output is divided by L once at the end. Returns ``(out, lse)`` like
    :func:`naive_attention` (lse in natural log).
    """
    scale = default_scale(q.shape[-1], scale)
    qk_scale = scale * LOG2E
    n_q, n_kv = q.shape[-2], k.shape[-2]
    acc_dtype = _accumulator_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for q_start in range(0, n_q, block_q):
        rows = torch.arange(q_start, min(q_start + block_q, n_q), device=q.device)
        qb = q[..., rows, :]
        m_i = torch.full(qb.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l_i = torch.zeros(qb.shape[:-1], dtype=acc_dtype, device=q.device)
        acc = torch.zeros(qb.shape, dtype=acc_dtype, device=q.device)
        kv_full_end, kv_end = kv_ranges(q_start, block_q, block_kv, n_kv, is_causal)
        for lo, hi, masked in ((0, kv_full_end, False), (kv_full_end, kv_end, True)):
            for kv_start in range(lo, hi, block_kv):
                cols = torch.arange(kv_start, min(kv_start + block_kv, n_kv), device=q.device)
                s = (qb @ k[..., cols, :].transpose(-2, -1)).to(acc_dtype)
                if masked and is_causal:
                    s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                m_new = torch.maximum(m_i, s.amax(dim=-1) * qk_scale)
                p = torch.exp2(s * qk_scale - m_new[..., None])
                alpha = torch.exp2(m_i - m_new)
                l_i = l_i * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + p.to(v.dtype).to(acc_dtype) @ v[..., cols, :].to(acc_dtype)
                m_i = m_new
        if n_kv == 0:
            out[..., rows, :] = 0
            lse[..., rows] = float("-inf")
            continue
        out[..., rows, :] = (acc / l_i[..., None]).to(q.dtype)
        lse[..., rows] = (m_i + torch.log2(l_i)) / LOG2E
    return out, lse


def attention_backward(q, k, v, o, do, lse, is_causal=False, scale=None):
    """dQ, dK, dV written from the formulas of chapter 06, with P rebuilt from the LSE:

    ``P = exp(S - LSE)``, ``dV = P^T dO``, ``dP = dO V^T``, ``Delta = rowsum(dO * O)``,
    ``dS = P * (dP - Delta)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.
    """
    scale = default_scale(q.shape[-1], scale)
    s = (q @ k.transpose(-2, -1)) * scale
    p = torch.exp(s - lse[..., None].to(s.dtype))
    if is_causal:
        p = p.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), 0.0)
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * (ds @ k)
    dk = scale * (ds.transpose(-2, -1) @ q)
    return dq, dk, dv


def decode_reference(q, k_cache, v_cache, cache_seqlens, scale=None, softcap=0.0, window=-1,
                     alibi_slopes=None, causal=True, cache_leftpad=None, window_right=-1):
    """Decoding against a KV cache (``flashattn.decode``) as the formula reads, one sequence at a
    time: query head ``h`` uses KV head ``h // (H_q / H_kv)``, only cache entries
    ``cache_leftpad[b] .. L - 1`` exist (from 0 without ``cache_leftpad``), and new token ``t``
    at position ``L - N_q + t`` sees keys up to it (bottom-right; every key unless ``causal``),
    only the last ``window + 1`` of them when ``window >= 0`` and none past ``window_right``
    after it when ``window_right >= 0``; ``softcap > 0`` caps the scaled scores (``softcap *
    tanh(S / softcap)``); ``alibi_slopes`` ``(H_q,)`` or ``(B, H_q)`` adds ``-slope * |L - N_q +
    t - j|``. A row that sees no key gets 0 and lse -inf.
    Computes in the inputs' dtype; returns ``(out, lse)``."""
    scale = default_scale(q.shape[-1], scale)
    n_heads, n_q = q.shape[1], q.shape[2]
    group = n_heads // k_cache.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulator_dtype(q.dtype), device=q.device)
    starts = [0] * len(cache_seqlens) if cache_leftpad is None else cache_leftpad.tolist()
    for b, (start, length) in enumerate(zip(starts, cache_seqlens.tolist())):
        k = k_cache[b, :, :length].repeat_interleave(group, dim=0)   # (H_q, L, D)
        v = v_cache[b, :, :length].repeat_interleave(group, dim=0)
        s = (q[b] @ k.transpose(-2, -1)) * scale                     # (H_q, N_q, L)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        position = length - n_q + torch.arange(n_q, device=q.device)[:, None]
        keys = torch.arange(length, device=q.device)[None, :]
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            s = s - slopes.to(s.dtype)[:, None, None] * (position - keys).abs().to(s.dtype)
        hidden = keys < start
        if causal:
            hidden = hidden | (keys > position)
        if window >= 0:
            hidden = hidden | (keys < position - window)
        if window_right >= 0:
            hidden = hidden | (keys > position + window_right)
        s = s.masked_fill(hidden, float("-inf"))
        lse[b] = torch.logsumexp(s.to(lse.dtype), dim=-1)
        seen = (lse[b] > float("-inf"))[..., None]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.where(seen, p @ v, torch.zeros((), dtype=q.dtype, device=q.device))
    return out, lse


def gather_pages(cache, block_table):
    """A paged cache ``(num_pages, page_size, H_kv, D)`` as the contiguous cache it stands for,
    ``(B, H_kv, max_blocks * page_size, D)``: sequence ``b``'s rows are its pages, in the order of
    ``block_table[b]``."""
    batch, blocks = block_table.shape
    pages = cache[block_table.long()]                    # (B, max_blocks, page_size, H_kv, D)
    return pages.reshape(batch, blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def decode_split_partials(q, k_cache, v_cache, cache_seqlens, num_splits, block_kv, scale=None):
    """The partial states the decode kernel's splits write (``flashattn.decode`` before its merge),
    from the formula: split ``s`` of a sequence reads keys ``[lo, hi)`` of
    ``traversal.decode_split_bounds`` and returns its own attention over them, ``O_s`` (divided by
    its own sum) and ``LSE_s`` in base 2 (log2 of the sum of exp of its scaled scores). A split
    without a visible key gives O_s = 0 and LSE_s = -inf. Returns ``(o_part, lse_part)`` of shapes
    ``(B, H_q, N_q, num_splits, D)`` and ``(B, H_q, N_q, num_splits)``, in the inputs' dtype."""
    scale = default_scale(q.shape[-1], scale)
    batch, n_heads, n_q, head_dim = q.shape
    group = n_heads // k_cache.shape[1]
    o_part = torch.zeros(batch, n_heads, n_q, num_splits, head_dim, dtype=q.dtype, device=q.device)
    lse_part = torch.full((batch, n_heads, n_q, num_splits), float("-inf"), dtype=q.dtype,
                          device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        position = length - n_q + torch.arange(n_q, device=q.device)[:, None]  # token t's place
        for split, (lo, hi) in enumerate(decode_split_bounds(length, n_q, num_splits, block_kv)):
            if lo == hi:
                continue
            k = k_cache[b, :, lo:hi].repeat_interleave(group, dim=0)   # (H_q, hi - lo, D)
            v = v_cache[b, :, lo:hi].repeat_interleave(group, dim=0)
            s = (q[b] @ k.transpose(-2, -1)) * scale                    # (H_q, N_q, hi - lo)
            seen = torch.arange(lo, hi, device=q.device)[None, :] <= position
            s = s.masked_fill(~seen, float("-inf"))
            lse_part[b, :, :, split] = torch.logsumexp(s, dim=-1) * LOG2E
            o_part[b, :, :, split] = torch.softmax(s, dim=-1) @ v
    return o_part, lse_part


def window_mask(n_q: int, n_kv: int, window_size=(-1, -1), is_causal=False, device=None) -> torch.Tensor:
    """Boolean (n_q, n_kv) mask, True where query i may see key j: ``j >= i - left`` (when
    ``left >= 0``), ``j <= i + right`` (when ``right >= 0``), and ``j <= i`` with ``is_causal``;
    top-left aligned like :func:`causal_mask`."""
    left, right = window_size
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_kv, device=device)[None, :]
    seen = torch.ones(n_q, n_kv, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    if is_causal:
        seen &= j <= i
    return seen


def masked_attention(q, k, v, is_causal=False, scale=None, enable_gqa=False, window_size=(-1, -1)):
    """Attention as the formula reads, with grouped heads and a sliding window
    (``flashattn.attention``'s ``enable_gqa`` and ``window_size``).

    ``q`` is ``(..., H_q, N_q, D)``; with ``enable_gqa`` ``k`` and ``v`` may have ``H_kv`` heads, a
    divisor of ``H_q``, and query head ``h`` uses K/V head ``h // (H_q // H_kv)``. A row that sees
    no key gets the output 0 and lse -inf, and gradients of 0 (never NaN): its scores are left
    unmasked inside the softmax and its probabilities multiplied by the all-False mask.
    Computes in the inputs' dtype; returns ``(out, lse)`` like :func:`naive_attention`.
    """
    scale = default_scale(q.shape[-1], scale)
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-2, -1)) * scale
    seen = window_mask(q.shape[-2], k.shape[-2], window_size, is_causal, q.device)
    empty = ~seen.any(dim=-1, keepdim=True)                  # rows that see no key
    s = s.masked_fill(~seen & ~empty, float("-inf"))
    lse = torch.logsumexp(s.to(_accumulator_dtype(s.dtype)), dim=-1)
    lse = lse.masked_fill(empty[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1) * seen
    return p @ v, lse


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=False, scale=None,
                     enable_gqa=False, window_size=(-1, -1), **mods):
    """Packed sequences (``flashattn.varlen_attention``) as the formula reads, one sequence at a
    time with :func:`masked_attention`: ``q`` is ``(total_q, H_q, D)``, ``k`` and ``v`` are
    ``(total_k, H_kv, D)`` and ``(total_k, H_kv, D_v)``, sequence ``b`` holds rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. Returns
    ``(out, lse)`` with ``lse`` of shape ``(H_q, total_q)``.

    ``mods``: :func:`modified_attention`'s keyword arguments, per sequence: ``alibi_slopes`` of
    shape ``(H_q,)`` or ``(batch, H_q)``; ``dropout_keep`` of shape ``(H_q, total_q, total_k)``,
    of which sequence ``b`` takes its own block (``flashattn.kernels.mods.dropout_mask``'s layout)."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        qs = q[bounds_q[b]:bounds_q[b + 1]].transpose(0, 1)       # (H_q, n_q, D)
        ks = k[bounds_k[b]:bounds_k[b + 1]].transpose(0, 1)
        vs = v[bounds_k[b]:bounds_k[b + 1]].transpose(0, 1)
        if ks.shape[1] == 0:  # no keys: an empty sum
            outs.append(q.new_zeros((qs.shape[1], qs.shape[0], v.shape[-1])) + 0 * q.sum())  # v's head dim
            lses.append(torch.full(qs.shape[:2], float("-inf"), dtype=_accumulator_dtype(q.dtype),
                                   device=q.device))
            continue
        if mods:
            seq = dict(mods)
            slopes = seq.get("alibi_slopes")
            if slopes is not None and slopes.dim() == 2:
                seq["alibi_slopes"] = slopes[b]
            if seq.get("dropout_keep") is not None:
                seq["dropout_keep"] = seq["dropout_keep"][:, bounds_q[b]:bounds_q[b + 1],
                                                          bounds_k[b]:bounds_k[b + 1]]
            o, lse = modified_attention(qs, ks, vs, None, seq.pop("dropout_p", 0.0), is_causal, scale,
                                        enable_gqa, window_size=window_size, **seq)
        else:
            o, lse = masked_attention(qs, ks, vs, is_causal, scale, enable_gqa, window_size)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def modified_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, window_size=(-1, -1), causal_alignment="top_left",
                       softcap=0.0, alibi_slopes=None, dropout_keep=None):
    """``flashattn.attention``'s arguments as the formula reads, on ``(..., H, N, D)`` tensors:

        S = softcap * tanh(scale * Q K^T / softcap) - slope_h * |pos(i) - j| + mask
        P = softmax(S over the keys i sees),   O = (P * keep / (1 - dropout_p)) V

    with ``pos(i) = i`` (top-left) or ``i + N_kv - N_q`` (bottom-right), the causal mask and the
    window taken at ``pos(i)``, a bool ``attn_mask`` hiding its False pairs. A row that sees no key
    gets the output 0 and lse -inf, with zero gradients. ``dropout_keep`` (bool, broadcastable to
    the scores) is the keep-mask, required when ``dropout_p > 0``. Returns ``(out, lse)``."""
    scale = default_scale(q.shape[-1], scale)
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    n_q, n_kv = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    shift = n_kv - n_q if causal_alignment == "bottom_right" else 0
    distance = (torch.arange(n_q, device=q.device)[:, None] + shift
                - torch.arange(n_kv, device=q.device)[None, :]).abs().to(s.dtype)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype)
        s = s - slopes[..., None, None] * distance
    seen = window_mask(n_q + max(shift, 0), n_kv, window_size, is_causal, q.device)[max(shift, 0):]
    if shift < 0:  # queries before the first key position: pad the top of the mask
        seen = window_mask(n_q, n_kv - shift, window_size, is_causal, q.device)[:, -shift:]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            seen = seen & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    s = s.masked_fill(~seen, float("-inf"))
    empty = (s == float("-inf")).all(dim=-1, keepdim=True)       # rows that see no key
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s.to(_accumulator_dtype(s.dtype)), dim=-1)
    lse = lse.masked_fill(empty[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    if dropout_p:
        if dropout_keep is None:
            raise ValueError("dropout_p > 0 needs the keep-mask dropout_keep")
        p = p * dropout_keep / (1.0 - dropout_p)
    return p @ v, lse
