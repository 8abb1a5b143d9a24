"""``flashattn.attention``: the public op, a drop-in for scaled_dot_product_attention.

This module checks the arguments (so that a mistake is reported in terms of the caller's
arguments, not as a crash inside Triton), brings any number of leading dims to the kernels'
(batch, heads, seq, head_dim) layout, and calls the autograd function.
"""
import math
import numbers

import numpy as np
import torch

from ..kernels.mods import dropout_mask
from .autograd import attention_op, natural_lse
from .modifiers import causal_bias, score_mods
from .modifiers import type_name as _type_name
from ..gpu.runtime import DEVICE, RUNTIME

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, return_lse=False, window_size=(-1, -1), causal_alignment="top_left", softcap=0.0,
              alibi_slopes=None, return_dropout_mask=False, deterministic=False):
    """Scaled dot-product attention, ``softmax(q @ k^T * scale) @ v``, computed by FlashAttention.

    A drop-in for ``torch.nn.functional.scaled_dot_product_attention``: its arguments in its order,
    then FlashAttention's own, keyword-only.

    Args:
        query, key, value (q, k, v below, SDPA's names): queries ``(..., N_q, D)``, keys
            ``(..., N_kv, D)`` and values ``(..., N_kv, D_v)``. Their leading dims broadcast as
            SDPA broadcasts them: a missing dim counts as 1, and a dim of 1 (k's and v's heads
            included) is read in place with stride 0, never copied; k and v must have the same
            leading dims. Any strides (a ``(B, N, H, D)`` tensor transposed to ``(B, H, N, D)``
            works as is). v may have a head dim of its own, as in SDPA (DeepSeek's MLA: D = 192,
            D_v = 128); D and D_v are each 1 to 256.
        attn_mask: None; a bool tensor (True: the pair takes part) or a float tensor (added to the
            scaled scores), broadcastable to ``(..., H, N_q, N_kv)``; or one of
            ``torch.nn.attention.bias.causal_upper_left/causal_lower_right(N_q, N_kv)``, which are
            ``is_causal`` aligned top-left or bottom-right. A tensor mask is read in place, tile by
            tile, a stride of 0 on each broadcast dim: a key-padding mask ``(B, 1, 1, N_kv)`` is
            never expanded (leading dims beyond batch and heads that broadcast partly are expanded
            to the batch). No gradient flows to it: a float mask that requires grad is refused.
            With ``is_causal=True`` as well, both apply: a pair takes part only where the mask
            keeps it and causality allows it (what SDPA's CPU path computed up to PyTorch 2.13;
            PyTorch 2.14 and some of SDPA's GPU backends refuse the pair of arguments instead).
        dropout_p: probability of dropping each attention probability (kept ones are scaled by
            ``1 / (1 - dropout_p)``), applied whenever > 0, as SDPA does. The mask is drawn in the
            kernel (Philox) from a seed taken from torch's default generator, so
            ``torch.manual_seed`` reproduces it; the backward regenerates it (nothing N x N stored).
            The returned lse is that of the scores before dropout. ``return_dropout_mask`` shows
            the mask a call drew.
        is_causal: mask so that query ``i`` sees keys ``0..pos(i)``, ``pos`` as ``causal_alignment``.
        scale: the factor applied to ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        enable_gqa: grouped-query attention, as SDPA's flag: ``q`` is ``(..., H_q, N_q, D)`` and
            ``k``, ``v`` are ``(..., H_kv, N_kv, D)`` with ``H_q`` a multiple of ``H_kv``; query head
            ``h`` reads K/V head ``h // (H_q // H_kv)``. The kernels read each group's K and V in
            place (no copy per query head), and the backward sums dK and dV over the group.
        return_lse: also return the log-sum-exp of each row of the scaled, masked scores.
        window_size: ``(left, right)``, a sliding window as in FlashAttention: query ``i`` sees key
            ``j`` only if ``j >= pos(i) - left`` (when ``left >= 0``) and ``j <= pos(i) + right``
            (when ``right >= 0``); -1 leaves that side unbounded; ``is_causal`` adds
            ``j <= pos(i)``. Tiles wholly outside the window are never loaded, so the cost grows
            with ``N * window``, not ``N**2``.
        causal_alignment: where query ``i`` sits among the keys, for ``is_causal``, the window and
            ALiBi: ``"top_left"`` (``pos(i) = i``, SDPA's ``is_causal``) or ``"bottom_right"``
            (``pos(i) = i + N_kv - N_q``, FlashAttention >= 2.1 and SDPA's ``causal_lower_right``:
            the last query sees every key). Tiles the mask hides are skipped in both.
        softcap: > 0 caps the scaled scores, ``S -> softcap * tanh(S / softcap)``, before the
            softmax (Gemma 2, Grok); 0 turns it off.
        alibi_slopes: None, or float32 slopes of shape ``(H_q,)`` or ``(..., H_q)`` (q's leading
            dims): the score of query ``i`` and key ``j`` gets ``- slope * |pos(i) - j|`` (ALiBi,
            added after the softcap). No gradient flows to the slopes.
        return_dropout_mask: also return the dropout mask this call drew, a bool tensor of shape
            ``(..., N_q, N_kv)`` (q's leading dims), True where a probability was kept (all True
            when ``dropout_p`` is 0), as FlashAttention's ``return_attn_probs`` serves its tests:
            a reference given this mask reproduces the call exactly. A debugging aid: it is
            formed in memory, N_q x N_kv per head, by the kernels' own random draw (and reading
            the call's seed on the host, it breaks a torch.compile graph). Pairs that the mask,
            the window or causality remove are False or True alike: they take no part anyway.
        deterministic: gradients bit-identical from run to run. By default the backward may add
            dQ's shares from different key blocks in an order that varies (on Hopper with Triton
            >= 3.8: one fused kernel, five tile products per pair of tiles), so dQ can differ in
            its last bits between runs; ``True`` (or ``torch.use_deterministic_algorithms(True)``)
            computes dQ in a kernel of its own instead, in a fixed order, at a cost the docs state
            (docs/performance.md). The forward is deterministic either way.

    A query that sees no key (outside every window, or masked out entirely) gets the output 0, the
    lse -inf and zero gradients (SDPA would give NaN for a fully masked row). Pairs are modified in
    this order: scale, softcap, ALiBi, attn_mask, the causal mask and window, then dropout.

    Returns:
        ``out`` of shape ``(..., N_q, D_v)`` in ``q``'s dtype, or ``(out, lse)`` with ``lse`` of shape ``(..., N_q)``,
        float32, natural log (``torch.logsumexp`` of the scores). Both are differentiable. With
        ``return_dropout_mask``, the mask comes last: ``(out, keep)`` or ``(out, lse, keep)``.

    Dtypes float16, bfloat16 and float32 are supported. float32 follows
    ``torch.get_float32_matmul_precision()``: 'highest' (PyTorch's default) keeps float32's
    accuracy (IEEE float32; ``FLASHATTN_TF32X3=1`` asks for 3xTF32 on tensor cores instead, which
    is experimental and warns); 'high' or 'medium' let the kernels use TF32 tensor cores, like
    PyTorch's own matmul.
    On the CPU (Triton's interpreter) bfloat16 inputs are computed in float32 and rounded back.
    Under ``torch.autocast``, q, k and v are cast to the autocast dtype first, as
    scaled_dot_product_attention does. It works under ``torch.compile`` (as one opaque operator,
    ``fullgraph=True`` included), ``torch.func.vmap`` (over q, k, v) and ``torch.func.grad``; it has
    no double backward (a gradient of the gradients raises a RuntimeError). Calls with a mask
    always run the Triton kernels; on an H100/H200 the others may run the Gluon kernels of
    ``flashattn.hopper`` (``flashattn.ops.dispatch`` says which).
    """
    q, k, v = _autocast(query, key, value)
    attn_mask, is_causal, causal_alignment = causal_bias(attn_mask, is_causal, causal_alignment, q, k)
    q, k, v, gqa = broadcast(q, k, v, enable_gqa)
    check_inputs(q, k, v, is_causal, scale, return_lse, gqa)
    window_size = check_window_size(window_size)
    for name, flag in (("return_dropout_mask", return_dropout_mask), ("deterministic", deterministic)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {_type_name(flag)}")
    is_causal, return_lse, deterministic = bool(is_causal), bool(return_lse), bool(deterministic)  # numpy bools too
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # The kernels index (batch, head, seq, head_dim) with a stride for each. A 3-D or 4-D input is
    # used as is (no copy); more leading dims are merged into the batch, which reshape does
    # without copying whenever their strides allow it.
    lead = q.shape[:-2]
    heads = lead[-1] if lead else 1
    batch = math.prod(lead[:-1])
    heads_kv = k.shape[-3] if k.dim() > 2 else 1
    mods = score_mods(q, k, attn_mask, dropout_p, is_causal, causal_alignment, softcap, alibi_slopes,
                      batch, heads)
    q4 = q.reshape(batch, heads, q.shape[-2], head_dim)
    k4, v4 = (t.reshape(batch, heads_kv, *t.shape[-2:]) for t in (k, v))
    out, lse2 = attention_op(q4, k4, v4, is_causal, scale, window_size, None, mods, deterministic)
    results = (out.reshape(*q.shape[:-1], v.shape[-1]),)
    if return_lse:
        results += (natural_lse(lse2).reshape(q.shape[:-1]),)
    if return_dropout_mask:
        results += (_drawn_mask(mods, (batch, heads, q.shape[-2], k.shape[-2]), q.device).reshape(
            *q.shape[:-1], k.shape[-2]),)
    return results if len(results) > 1 else results[0]


def _drawn_mask(mods, shape, device):
    """The keep-mask of a call whose additions are ``mods`` (None: nothing, so no dropout)."""
    if mods is None or not mods.dropout_p:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return dropout_mask(shape, mods.dropout_p, mods.seed, device)


def broadcast(q, k, v, enable_gqa):
    """``(q, k, v, gqa)``: the inputs with their leading dims broadcast as SDPA broadcasts them, by
    views (stride 0 on a broadcast dim, no copy), and whether the kernels group K/V heads.

    A missing leading dim counts as 1; a dim of 1 takes the other side's size. In the heads dim
    (the last leading one) k's and v's single head serves every query head as a group of all
    of them (read in place, its gradient summed by the kernels), and q's single head is expanded.
    Anything that does not broadcast is left as it is, for :func:`check_inputs` to name."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)) \
            or not isinstance(enable_gqa, (bool, np.bool_)) or k.shape[:-2] != v.shape[:-2]:
        return q, k, v, enable_gqa
    if q.shape[:-2] == k.shape[:-2]:
        return q, k, v, enable_gqa
    n = max(q.dim(), k.dim()) - 2
    lead_q = (1,) * (n - q.dim() + 2) + tuple(q.shape[:-2])
    lead_k = (1,) * (n - k.dim() + 2) + tuple(k.shape[:-2])
    if any(a != b and 1 not in (a, b) for a, b in zip(lead_q[:-1], lead_k[:-1])):
        return q, k, v, enable_gqa
    batch = tuple(max(a, b) for a, b in zip(lead_q[:-1], lead_k[:-1]))
    heads_q, heads_kv = lead_q[-1], lead_k[-1]
    gqa = bool(enable_gqa)
    if heads_q == 1 and heads_kv > 1:
        heads_q = heads_kv       # q's one head broadcast over k's
    elif heads_kv == 1 and heads_q > 1:
        gqa = True               # one K/V head for all query heads: a group of H_q, in place
    q = _viewed(q, (*batch, heads_q))
    k, v = (_viewed(t, (*batch, heads_kv)) for t in (k, v))
    return q, k, v, gqa


def _viewed(t, lead):
    """``t`` with leading dims ``lead``: itself if it has them, else a view (1s added in front,
    dims of 1 expanded)."""
    if tuple(t.shape[:-2]) == lead:
        return t
    t = t.reshape((1,) * (len(lead) + 2 - t.dim()) + tuple(t.shape))
    return t if tuple(t.shape[:-2]) == lead else t.expand(*lead, *t.shape[-2:])


def _autocast(q, k, v):
    """Under ``torch.autocast`` on the inputs' device, the 16- and 32-bit float inputs cast to the
    autocast dtype (what autocast does for scaled_dot_product_attention); else unchanged."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # check_inputs names the culprit
    device = q.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):  # check_inputs refuses others
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.dtype in SUPPORTED_DTYPES else t for t in tensors)


def check_inputs(q, k, v, is_causal, scale, return_lse, enable_gqa=False):
    """Raise TypeError or ValueError naming the argument and what was expected."""
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {_type_name(enable_gqa)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 "
                            "or torch.float32")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., seq_len, head_dim); "
                             f"got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must be "
                             "on the same device")
        if t.shape[:-2] != q.shape[:-2]:
            _check_heads(name, t, q, enable_gqa)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has {q.shape[-1]}; they must be equal "
                         "(v may have a head dim of its own)")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k has leading dims {tuple(k.shape[:-2])} but v has {tuple(v.shape[:-2])}; "
                         "they must be equal")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k has {k.shape[-2]} keys but v has {v.shape[-2]} values; "
                         "their sequence lengths must be equal")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q and k) is {q.shape[-1]}; expected 1 to "
                         f"{MAX_HEAD_DIM}")
    if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"v's head dim (its last dim) is {v.shape[-1]}; expected 1 to {MAX_HEAD_DIM}")
    if q.device.type != DEVICE.type:
        where = "a CUDA GPU" if DEVICE.type == "cuda" else "the CPU (Triton's interpreter)"
        raise ValueError(f"q is on {q.device}, but flashattn runs on {where} here: pass tensors "
                         f"on {DEVICE.type} (flashattn.RUNTIME is {RUNTIME!r})")
    for name, flag in (("is_causal", is_causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {_type_name(flag)}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {_type_name(scale)}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite positive number, got {scale}")


def _check_heads(name, t, q, enable_gqa):
    """``t`` (k or v) has other leading dims than ``q``: fine only for grouped-query attention,
    where they differ in the heads dim alone and H_kv divides H_q; else a ValueError."""
    broadcast = all(n in (1, m) for n, m in zip(t.shape[:-3], q.shape[:-3]))  # SDPA's broadcasting
    if t.dim() < 3 or q.dim() < 3 or not broadcast or t.dim() != q.dim():
        raise ValueError(f"{name} has leading dims {tuple(t.shape[:-2])} but q has "
                         f"{tuple(q.shape[:-2])}; they must be equal, or 1 where q's are not "
                         "(broadcast), apart from the heads under enable_gqa")
    heads_q, heads_kv = q.shape[-3], t.shape[-3]
    if heads_kv == heads_q:
        return
    if not enable_gqa:
        raise ValueError(f"{name} has leading dims {tuple(t.shape[:-2])} but q has {tuple(q.shape[:-2])}: "
                         f"{name} has {heads_kv} heads but q has {heads_q}; they must be equal, or pass "
                         "enable_gqa=True for grouped-query attention")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"enable_gqa=True needs q's heads to be a multiple of {name}'s heads; got "
                         f"{heads_q} query heads and {heads_kv} {name} heads")


def check_window_size(window_size):
    """``window_size`` as a tuple ``(left, right)`` of ints >= -1, or a TypeError/ValueError
    naming it."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError("window_size must be a pair (left, right) of ints (-1 for unbounded), got "
                        f"{window_size!r}")
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size must be a pair of ints, got {window_size!r}")
        if side < -1:
            raise ValueError(f"window_size={tuple(window_size)!r}: each side must be >= 0, or -1 "
                             "for unbounded")
    return int(window_size[0]), int(window_size[1])
