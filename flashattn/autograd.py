"""The torch.autograd.Function that joins the forward and backward kernels.

The forward saves Q, K, V, the output O and the base-2 log-sum-exp, nothing of size N_q x N_kv;
the backward rebuilds what it needs from them. Tensors here are (B, H, N, D); flashattn.api
reshapes whatever the user passed to that.
"""
import torch

from .backward import attention_backward
from .forward import attention_forward
from .tiles import LN2


class FlashAttention(torch.autograd.Function):
    """``apply(q, k, v, is_causal, scale, window_size=(-1, -1), sequences=None) -> (out, lse)``, lse
    in natural log like torch.logsumexp. ``k``/``v`` may have fewer heads than ``q`` (grouped-query
    attention); ``sequences`` marks packed sequences (``flashattn.varlen``)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, window_size=(-1, -1), sequences=None):
        o, lse2 = attention_forward(q, k, v, is_causal, scale, window_size=window_size,
                                    sequences=sequences)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.window_size, ctx.sequences = window_size, sequences
        ctx.set_materialize_grads(False)  # an unused output gets None, not a tensor of zeros
        lse = lse2 * LN2
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse2 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = attention_backward(q, k, v, o, lse2, do, ctx.is_causal, ctx.scale, dlse=dlse,
                                        window_size=ctx.window_size, sequences=ctx.sequences)
        return dq, dk, dv, None, None, None, None
