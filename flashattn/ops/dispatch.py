"""Which kernels run an attention call: the Gluon kernels for Hopper where they apply and were
measured faster, the Triton kernels everywhere else.

Both compute the same output and the same base-2 LSE in the same layout, so they mix within one
call: on an H100/H200 a 16-bit forward at head dims 64 and 128 takes ``flashattn.hopper.forward``
(grouped heads too, sliding windows where every query block sees some key, ALiBi, the
bottom-right alignment, dropout, and a softcap where the kernels' tanh is the approximate one).
The backward (the same calls, any window, any softcap) takes, with a Triton whose Gluon has TMA
reduce-adds (3.8 and later), all three gradients from the
fused kernel of ``flashattn.hopper.backward`` (dQ added by reduce-adds, in an order that varies),
unless ``deterministic`` asks for gradients bit-identical from run to run; else its dK/dV from the
Gluon dK/dV kernel at the head dims of :data:`GLUON_DKDV_HEAD_DIMS` and its Delta and dQ from the
Triton kernels (grouped heads too). Packed sequences and a fixed configuration take the Triton
kernels; so does every call with ``FLASHATTN_GLUON=0``.

So does every call whose v has a head dim of its own (D_v != D, as in DeepSeek's MLA): the Gluon
kernels hold V and O in tiles of q's head dim.

So does every call with an attn_mask (the Gluon kernels do not implement one, and computing
without it would be silently wrong), but, with ``hopper.FUSED_KEY_MASKS`` (on by default), for the fused
backward's key-padding masks: a bool mask with one row of keys per batch, the same for every head
and query (``(B, 1, 1, N_kv)``), which that kernel reads once per key
(``hopper.backward_key_mask``). Their forward stays on the Triton kernels, which skip the hidden
keys' tiles.
"""
import functools

import torch

from .. import hopper
from ..kernels import backward, forward
from ..kernels.mods import NO_MODS
from ..kernels.traversal import aligned_bounds, window_masking

#: Head dims at which the backward takes dK/dV from the Gluon kernel on Hopper. On an H200 (B = 4,
#: H = 32, N = 4096 and 8192, fp16 and bf16) the whole backward with it reached 0.72-0.80x of SDPA's
#: default (cuDNN) at head dim 128, against 0.69-0.72x with the Triton dK/dV kernel, but 0.74-0.82x
#: at head dim 64, where the Triton kernel reached 0.80-0.87x
#: (docs/gpu-record/2026-12-01-0832-gluon-forward-backward-bench.csv).
GLUON_DKDV_HEAD_DIMS = (128,)


def gluon_call(q, k, v, is_causal, window_size, sequences, mods, key_masks=False):
    """What the Gluon kernels need of a call they compute, as keyword arguments of
    ``hopper.forward.attention_forward`` and ``hopper.backward.attention_backward`` (``causal``, the
    ``window`` bounds moved to the bottom-right alignment where it applies, ``softcap``,
    ``alibi_slopes``, ``shift``, under dropout ``dropout_p`` and ``seed``, and with ``key_masks``
    (the fused backward) and ``hopper.FUSED_KEY_MASKS`` a key-padding mask as ``key_mask``); None
    for a call they do not compute:
    packed sequences, any other attn_mask, v with a head dim of its own."""
    mods = mods or NO_MODS
    key_mask = hopper.backward_key_mask(mods.attn_mask) if key_masks and hopper.FUSED_KEY_MASKS else None
    if sequences is not None or v.shape[-1] != q.shape[-1] or (mods.attn_mask is not None and key_mask is None):
        return None
    n_q, n_kv = q.shape[2], k.shape[2]
    aligned = mods.aligned_bottom_right(n_q, n_kv, False)
    causal, window, left, right = window_masking(is_causal, window_size, n_q + n_kv, aligned)
    shift = n_kv - n_q if aligned else 0
    bounds = aligned_bounds(left, right, n_q, n_kv) if aligned else (left, right)
    call = dict(is_causal=causal, window=bounds if window else None, softcap=mods.softcap,
                alibi_slopes=mods.alibi_slopes, shift=shift)
    if mods.dropout_p > 0:  # the Triton kernels' pairs (tiles.dropout_keep): the two mix in a call
        call.update(dropout_p=mods.dropout_p, seed=int(mods.seed))
    if key_mask is not None:
        call.update(key_mask=key_mask)
    return call


def attention_forward(q, k, v, is_causal, scale, config=None, window_size=(-1, -1), sequences=None,
                      lse_dtype=torch.float32, mods=None):
    """``(o, lse2)`` as :func:`flashattn.kernels.forward.attention_forward` computes them, from
    the Gluon forward where it applies (see the module's docstring)."""
    call = gluon_call(q, k, v, is_causal, window_size, sequences, mods) if config is None else None
    gluon = hopper.load("forward") if call is not None else None
    # The softcap with the exact tanh (``hopper.forward.TANH_APPROX`` off): on an H100 (bf16,
    # causal, B = 4, H = 32, N = 8192) the Gluon forward took 10.1 ms in two runs, the Triton
    # forward 8.9 ms in an earlier one; likely (not profiled) its three special-function
    # instructions per score (exp2, the division's reciprocal, the softmax's exp2) leave the Gluon
    # kernel's overlap nothing to gain (docs/performance.md).
    exact_softcap = gluon is not None and call["softcap"] > 0 and not gluon.TANH_APPROX
    if gluon is not None and not exact_softcap and gluon.supports(q, k, v, window=call["window"]):
        return gluon.attention_forward(q, k, v, scale=scale, **call)
    return forward.attention_forward(q, k, v, is_causal, scale, config, window_size, sequences, lse_dtype,
                                     mods)


def attention_backward(q, k, v, o, lse2, do, is_causal, scale, dlse=None, configs=None,
                       window_size=(-1, -1), sequences=None, mods=None, deterministic=False):
    """``(dq, dk, dv)`` as :func:`flashattn.kernels.backward.attention_backward` computes them.

    On Hopper, for the calls the Gluon kernels compute (see the module's docstring): with a Triton
    whose Gluon has TMA reduce-adds (3.8 and later) and unless ``deterministic`` (or
    ``torch.use_deterministic_algorithms``) asks for gradients bit-identical from run to run, one
    Gluon kernel computes dK, dV and dQ (:func:`flashattn.hopper.backward.attention_backward`,
    five tile products per pair of tiles); else dK/dV come from the Gluon kernel at the head dims
    of :data:`GLUON_DKDV_HEAD_DIMS` and dQ from the Triton kernel (seven tile products)."""
    configs = configs or {}
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    fused = not deterministic and configs.get("bwd_dq") is None  # if this Triton's Gluon has the reduce-add
    call = gluon_call(q, k, v, is_causal, window_size, sequences, mods, key_masks=fused) \
        if configs.get("bwd_dkdv") is None else None
    gluon = hopper.load("backward") if call is not None else None
    if gluon is not None and not gluon.supports(q, k, v):
        gluon = None
    if gluon is not None and "key_mask" in call and not gluon.has_dq_reduce():
        gluon = None  # the dK/dV kernel alone would need the Triton dQ kernel's mask lists
    if gluon is not None:  # the kernels' own masking and modifications, in place of the Triton ones'
        call = {name: value for name, value in call.items() if name != "is_causal"}
    if gluon is not None and fused and gluon.has_dq_reduce():
        return backward.attention_backward(q, k, v, o, lse2, do, is_causal, scale, dlse, configs,
                                           window_size, sequences, mods=mods,
                                           fused=functools.partial(gluon.attention_backward, **call))
    use_dkdv = gluon is not None and q.shape[-1] in GLUON_DKDV_HEAD_DIMS
    return backward.attention_backward(q, k, v, o, lse2, do, is_causal, scale, dlse, configs,
                                       window_size, sequences, mods=mods,
                                       dkdv=functools.partial(gluon.attention_backward_dkdv, **call) if use_dkdv
                                       else None)
