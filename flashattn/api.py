"""``flashattn.attention``: the public op, a drop-in for scaled_dot_product_attention.

This module checks the arguments (so that a mistake is reported in terms of the caller's
arguments, not as a crash inside Triton), brings any number of leading dims to the kernels'
(batch, heads, seq, head_dim) layout, and calls the autograd function.
"""
import math
import numbers

import numpy as np
import torch

from .autograd import FlashAttention
from .runtime import DEVICE, RUNTIME

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def attention(q, k, v, is_causal=False, scale=None, return_lse=False):
    """Scaled dot-product attention, ``softmax(q @ k^T * scale) @ v``, computed by FlashAttention.

    Args:
        q: queries, shape ``(..., N_q, D)``.
        k, v: keys and values, shape ``(..., N_kv, D)``, with the same leading dims as ``q``.
            Any strides (a ``(B, N, H, D)`` tensor transposed to ``(B, H, N, D)`` works as is).
        is_causal: mask so that query ``i`` sees keys ``0..i`` (top-left aligned, like SDPA).
        scale: the factor applied to ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of each row of the scaled, masked scores.

    Returns:
        ``out`` with ``q``'s shape and dtype, or ``(out, lse)`` with ``lse`` of shape ``(..., N_q)``,
        float32, natural log (``torch.logsumexp`` of the scores). Both are differentiable.

    Dtypes float16, bfloat16 and float32 are supported. float32 follows
    ``torch.get_float32_matmul_precision()``: 'highest' (PyTorch's default) keeps float32's
    accuracy (3xTF32 on tensor cores, IEEE fp32 where there are none); 'high' or 'medium' let the
    kernels use TF32 tensor cores, like PyTorch's own matmul.
    On the CPU (Triton's interpreter) bfloat16 inputs are computed in float32 and rounded back.
    Under ``torch.autocast``, q, k and v are cast to the autocast dtype first, as
    scaled_dot_product_attention does. It works under ``torch.compile`` (as one opaque operator),
    ``torch.func.vmap`` and ``torch.func.grad``; it has no double backward (a gradient of the
    gradients raises a RuntimeError).
    """
    q, k, v = _autocast(q, k, v)
    _check(q, k, v, is_causal, scale, return_lse)
    is_causal, return_lse = bool(is_causal), bool(return_lse)  # numpy bools too
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # The kernels index (batch, head, seq, head_dim) with a stride for each. A 3-D or 4-D input is
    # used as is (no copy); more leading dims are merged into the batch, which reshape does
    # without copying whenever their strides allow it.
    lead = q.shape[:-2]
    heads = lead[-1] if lead else 1
    batch = math.prod(lead[:-1])
    q4, k4, v4 = (t.reshape(batch, heads, t.shape[-2], head_dim) for t in (q, k, v))
    out, lse, _ = FlashAttention.apply(q4, k4, v4, is_causal, scale)
    out = out.reshape(q.shape)
    return (out, lse.reshape(q.shape[:-1])) if return_lse else out


def _autocast(q, k, v):
    """Under ``torch.autocast`` on the inputs' device, the 16- and 32-bit float inputs cast to the
    autocast dtype (what autocast does for scaled_dot_product_attention); else unchanged."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # _check names the culprit
    device = q.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):  # _check refuses others
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.dtype in SUPPORTED_DTYPES else t for t in tensors)


def _type_name(x):
    """``bool``, ``int``, ``numpy.float64``: the type's name, with its module where not built in."""
    kind = type(x)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _check(q, k, v, is_causal, scale, return_lse):
    """Raise TypeError or ValueError naming the argument and what was expected."""
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
            raise ValueError(f"{name} has leading dims {tuple(t.shape[:-2])} but q has "
                             f"{tuple(q.shape[:-2])}; they must be equal (no broadcasting)")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} has head dim {t.shape[-1]} but q has {q.shape[-1]}; "
                             "they must be equal")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k has {k.shape[-2]} keys but v has {v.shape[-2]} values; "
                         "their sequence lengths must be equal")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q, k, v) is {q.shape[-1]}; expected 1 to "
                         f"{MAX_HEAD_DIM}")
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
