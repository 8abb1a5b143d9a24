"""The torch.autograd.Function that joins the forward and backward kernels.

The forward saves Q, K, V, the output O and the base-2 log-sum-exp, nothing of size N_q x N_kv;
the backward rebuilds what it needs from them. Tensors here are (B, H, N, D); flashattn.api
reshapes whatever the user passed to that.
"""
import math

import torch

from .backward import attention_backward
from .forward import attention_forward
from .runtime import INTERPRET

LN2 = math.log(2.0)


def _kernel_dtype(*tensors):
    """The interpreter runs tl.dot through NumPy, which has no bfloat16: there, bf16 tensors are
    upcast to float32 before the kernels (the same numbers, loaded wider) and results are rounded
    back to bf16 afterwards. On a GPU the kernels read bf16 directly."""
    if INTERPRET and tensors[0].dtype == torch.bfloat16:
        return [None if t is None else t.float() for t in tensors]
    return list(tensors)


class FlashAttention(torch.autograd.Function):
    """``apply(q, k, v, is_causal, scale) -> (out, lse)``, lse in natural log like torch.logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        o, lse2 = attention_forward(*_kernel_dtype(q, k, v), is_causal, scale)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.set_materialize_grads(False)  # an unused output gets None, not a tensor of zeros
        lse = lse2 * LN2
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse2 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        kq, kk, kv, ko, kdo = _kernel_dtype(q, k, v, o, do)
        dq, dk, dv = attention_backward(kq, kk, kv, ko, lse2, kdo, ctx.is_causal, ctx.scale,
                                        dlse=dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
