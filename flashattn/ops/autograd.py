"""The torch.autograd.Function that joins the forward and backward kernels.

The forward saves Q, K, V, the output O and the base-2 log-sum-exp, nothing of size N_q x N_kv;
the backward rebuilds what it needs from them. Tensors here are (B, H, N, D); flashattn.ops.attention
reshapes whatever the user passed to that.

The two launchers are registered as PyTorch operators (``torch.ops.flashattn.forward`` and
``torch.ops.flashattn.backward``), so that ``torch.compile`` sees them as single opaque calls with
known output shapes instead of trying to trace Triton's launch machinery, and ``torch.func.vmap``
folds its extra dim into the batch.
"""
import torch

from ..gpu.runtime import kernel_dtype
from ..kernels.forward import empty_output
from ..kernels.mods import ScoreMods
from ..kernels.sequences import Sequences
from ..kernels.tiles import LN2, LOG2E
from . import warmup
from .dispatch import attention_backward, attention_forward

#: CUDA's limit on grid axes 1 and 2 (heads, batch): larger inputs are launched in slices.
MAX_GRID_DIM = 65535


def attention_op(q, k, v, is_causal, scale, window_size=(-1, -1), sequences=None, mods=None,
                 deterministic=False):
    """``(out, lse2)`` as :class:`FlashAttention` computes them, through autograd only when a
    gradient may be asked for (``deterministic``: the backward's, see
    :func:`flashattn.ops.dispatch.attention_backward`).

    Without one the operator is called directly: torch.compile (torch 2.13) traces an
    autograd.Function's ``forward`` under no_grad with its arguments bound one place off (the
    ``forward`` here takes no ``ctx``), which made fullgraph inference fail with "'float' object is
    not iterable" at the window's unpacking; and an inference call has no backward to prepare."""
    tensors = (q, k, v) + ((mods.alibi_slopes, mods.attn_mask) if mods is not None else ())
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return FlashAttention.apply(q, k, v, is_causal, scale, window_size, sequences, mods, bool(deterministic))
    return torch.ops.flashattn.forward(q, k, v, is_causal, scale, *window_size, *_sequence_args(sequences),
                                       *_mod_args(mods))


class FlashAttention(torch.autograd.Function):
    """``apply(q, k, v, is_causal, scale, window_size=(-1, -1), sequences=None, mods=None,
    deterministic=False) -> (out, lse2)``,
    lse2 the base-2 log-sum-exp of each row (float32, float64 for float32 kernels), which
    :func:`natural_lse` turns into the public one. ``k``/``v`` may have fewer heads than ``q``
    (grouped-query attention); ``sequences`` marks packed sequences (``flashattn.ops.varlen``);
    ``mods`` (a ``flashattn.kernels.mods.ScoreMods``) the softcap, ALiBi, mask, dropout and alignment;
    ``deterministic`` asks the backward for gradients bit-identical from run to run.

    Both outputs are differentiable, and the natural-log LSE is computed outside, by autograd:
    with ``lse2`` returned as a third, non-differentiable output beside a natural-log ``lse`` of
    the same shape and dtype, torch.compile's inductor (torch 2.11, on a GPU) handed the backward
    a zero gradient for ``lse`` (measured: dQ and dK wrong, dV right)."""

    generate_vmap_rule = True  # torch.func.vmap runs forward and backward on batched tensors

    @staticmethod
    def forward(q, k, v, is_causal, scale, window_size=(-1, -1), sequences=None, mods=None, deterministic=False):
        return torch.ops.flashattn.forward(q, k, v, is_causal, scale, *window_size, *_sequence_args(sequences),
                                           *_mod_args(mods), deterministic)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale, *rest = inputs
        o, lse2 = output
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.window_size = tuple(rest[0]) if rest else (-1, -1)
        ctx.sequences = rest[1] if len(rest) > 1 else None
        ctx.mods = rest[2] if len(rest) > 2 else None
        ctx.deterministic = rest[3] if len(rest) > 3 else False
        ctx.set_materialize_grads(False)  # an unused output gets None, not a tensor of zeros

    @staticmethod
    def backward(ctx, do, dlse2):
        q, k, v, o, lse2 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        # lse2 = lse * log2(e): the kernels take the gradient reaching the natural-log LSE
        dlse = None if dlse2 is None else dlse2 * LOG2E
        differentiable = torch.is_grad_enabled()
        with torch.no_grad():
            dq, dk, dv = torch.ops.flashattn.backward(q, k, v, o, lse2, do, dlse, ctx.is_causal, ctx.scale,
                                                      *ctx.window_size, *_sequence_args(ctx.sequences),
                                                      *_mod_args(ctx.mods), ctx.deterministic)
        if differentiable:  # create_graph=True: these gradients may be differentiated
            dq, dk, dv = _FirstOrderOnly.apply(dq, dk, dv, q, k, v, o, do)
        return dq, dk, dv, None, None, None, None, None, None


def natural_lse(lse2):
    """The public LSE, ``torch.logsumexp`` of the scaled scores, float32, from the kernels' base-2
    ``lse2`` (differentiable)."""
    return (lse2 * LN2).to(torch.float32)


class _FirstOrderOnly(torch.autograd.Function):
    """``apply(dq, dk, dv, *inputs) -> (dq, dk, dv)``, copies whose own backward refuses.

    The backward kernels compute dQ, dK, dV but not their derivatives: differentiating them again
    needs second-order terms that no kernel here computes. Refuse, rather than return a second
    derivative that silently misses those terms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "flashattn.attention does not support double backward (a gradient of its gradients, "
            "e.g. torch.autograd.grad(..., create_graph=True) followed by a second grad). Use "
            "torch.nn.functional.scaled_dot_product_attention with the math backend "
            "(torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)) for that.")


# -- The operators -----------------------------------------------------------------------------
# Operators take tensors, numbers and lists only: the window is two ints, and packed sequences
# (flashattn.kernels.sequences.Sequences) travel as their cu_seqlens tensors and their lengths on the host.

def operator(impl):
    """Register ``impl`` (a function whose name is ``_<name>_op``, with type hints) as the PyTorch
    operator ``flashattn::<name>`` and return it.

    ``torch.library.custom_op`` would do the same in one decorator, but it wraps the function so
    that its first call imports torch._dynamo, which every program's first attention call then
    waits for (measured: 1.7 s on a CPU machine; 6 s on an H200 machine whose packages had no
    compiled bytecode). Defining the schema (inferred from the type hints) and registering the
    function for every device, as below, imports nothing."""
    name = impl.__name__.removeprefix("_").removesuffix("_op")
    torch.library.define(f"flashattn::{name}", torch.library.infer_schema(impl, mutates_args=()))
    torch.library.impl(f"flashattn::{name}", "default", impl)
    return impl


def _sequence_args(sequences):
    if sequences is None:
        return None, None, None, None
    return (sequences.cu_seqlens_q, sequences.cu_seqlens_k,
            [int(n) for n in sequences.lengths_q], [int(n) for n in sequences.lengths_k])


def _mod_args(mods):
    """A ScoreMods as the operators' arguments: (softcap, alibi_slopes, attn_mask, dropout_p, seed,
    bottom_right), the seed a 0-dim int64 tensor (drawn in the graph under torch.compile)."""
    if mods is None:
        return 0.0, None, None, 0.0, None, False
    return (mods.softcap, mods.alibi_slopes, mods.attn_mask, mods.dropout_p, mods.seed, mods.bottom_right)


def _mods(softcap, alibi_slopes, attn_mask, dropout_p, seed, bottom_right):
    if not (softcap or alibi_slopes is not None or attn_mask is not None or dropout_p or bottom_right):
        return None
    return ScoreMods(softcap, alibi_slopes, attn_mask, dropout_p, 0 if seed is None else int(seed), bottom_right)


def _sequences(cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k):
    if cu_seqlens_q is None:
        return None
    return Sequences(cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k)


def _sliced(fn, tensors, *args):
    """``fn(*tensors, *args)`` on (B, H, ...) tensors, run on (batch, heads) slices of at most
    MAX_GRID_DIM each and joined: one launch per slice. A single call when the whole input fits
    (the usual case: no copy). ``tensors[1:3]`` are K and V, whose heads may be fewer (grouped
    heads): a slice of query heads takes the K/V heads of its groups."""
    batch, heads = tensors[0].shape[:2]
    if (batch <= MAX_GRID_DIM and heads <= MAX_GRID_DIM) or batch * heads == 0:
        return fn(*tensors, *args)
    group = heads // tensors[1].shape[1]
    step = MAX_GRID_DIM // group * group

    def piece(i, t, b, h):
        if t is None:
            return None
        h0, h1 = (h // group, (h + step) // group) if i in (1, 2) else (h, h + step)
        return t[b:b + MAX_GRID_DIM, h0:h1]

    rows = []
    for b in range(0, batch, MAX_GRID_DIM):
        row = [fn(*(piece(i, t, b, h) for i, t in enumerate(tensors)), *args) for h in range(0, heads, step)]
        rows.append([torch.cat(parts, dim=1) for parts in zip(*row)])
    return tuple(torch.cat(parts, dim=0) for parts in zip(*rows))


@operator
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                window_left: int, window_right: int, cu_seqlens_q: torch.Tensor | None,
                cu_seqlens_k: torch.Tensor | None, lengths_q: list[int] | None,
                lengths_k: list[int] | None, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                bottom_right: bool = False, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse2)`` of :func:`flashattn.ops.dispatch.attention_forward`. On a GPU, when a gradient
    may follow, the backward's kernels start compiling beside the forward's (flashattn.ops.warmup;
    not for calls with score modifications, whose kernels are other variants): those of the
    backward ``deterministic`` asks for."""
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k)
    mods = _mods(softcap, alibi_slopes, attn_mask, dropout_p, seed, bottom_right)
    if mods is None:
        warmup.start(q, k, v, is_causal, scale, (window_left, window_right), sequences, _lse_dtype(q),
                     deterministic)

    def run(q, k, v):
        return attention_forward(q, k, v, is_causal, scale, None, (window_left, window_right),
                                 sequences, _lse_dtype(q), mods=mods)
    if mods is not None:  # the mask and the slopes index batch and heads: one launch, no slices
        _check_grid(q)
        return run(q, k, v)
    return _sliced(run, (q, k, v))


def _check_grid(q):
    if q.shape[0] > MAX_GRID_DIM or q.shape[1] > MAX_GRID_DIM:
        raise ValueError(f"an attn_mask, dropout, softcap, ALiBi or the bottom-right alignment with "
                         f"{q.shape[0]} batch elements and {q.shape[1]} heads: at most {MAX_GRID_DIM} of "
                         "each are supported with them (calls without them are launched in slices)")


@torch.library.register_fake("flashattn::forward")
def _(q, k, v, is_causal, scale, *variants):
    # O has v's head dim, allocated as the kernels' launcher allocates it (same strides)
    return empty_output(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


def _lse_dtype(q):
    """float64 where the kernels compute in float32: see attention_forward's ``lse_dtype``."""
    return torch.float64 if kernel_dtype(q)[0].dtype == torch.float32 else torch.float32


@operator
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse2: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None, is_causal: bool,
                 scale: float, window_left: int, window_right: int, cu_seqlens_q: torch.Tensor | None,
                 cu_seqlens_k: torch.Tensor | None, lengths_q: list[int] | None,
                 lengths_k: list[int] | None, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                 bottom_right: bool = False,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`flashattn.ops.dispatch.attention_backward`."""
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k)
    mods = _mods(softcap, alibi_slopes, attn_mask, dropout_p, seed, bottom_right)
    warmup.wait()  # for the kernels flashattn.ops.warmup is compiling, if any

    def run(q, k, v, o, lse2, do, dlse):
        # The kernels index the LSE as a contiguous (B, H, N_q) array: a slice of it is not one.
        return attention_backward(q, k, v, o, lse2.contiguous(), do, is_causal, scale, dlse=dlse,
                                  window_size=(window_left, window_right), sequences=sequences, mods=mods,
                                  deterministic=deterministic)
    if mods is not None:
        return run(q, k, v, o, lse2, do, dlse)
    return _sliced(run, (q, k, v, o, lse2, do, dlse))


@torch.library.register_fake("flashattn::backward")
def _(q, k, v, o, lse2, do, dlse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _folded(tensor, in_dim, size):
    """``tensor`` with vmap's dim ``in_dim`` (None: not batched) folded into the leading dim."""
    if tensor is None:
        return None
    tensor = tensor.unsqueeze(0).expand(size, *tensor.shape) if in_dim is None else tensor.movedim(in_dim, 0)
    return tensor.reshape(size * tensor.shape[1], *tensor.shape[2:])


def _unfolded(tensor, size):
    return tensor.reshape(size, tensor.shape[0] // size, *tensor.shape[1:])


@torch.library.register_vmap("flashattn::forward")
def _(info, in_dims, q, k, v, is_causal, scale, *variants):
    if variants[2] is not None:
        raise NotImplementedError("torch.func.vmap over flashattn.varlen_attention is not supported")
    _refuse_batched_mods(in_dims[5:])
    n = info.batch_size
    folded = (_folded(t, d, n) for t, d in zip((q, k, v), in_dims[:3]))
    o, lse2 = torch.ops.flashattn.forward(*folded, is_causal, scale, *_repeated_mods(variants, n))
    return (_unfolded(o, n), _unfolded(lse2, n)), (0, 0)


@torch.library.register_vmap("flashattn::backward")
def _(info, in_dims, q, k, v, o, lse2, do, dlse, is_causal, scale, *variants):
    if variants[2] is not None:
        raise NotImplementedError("torch.func.vmap over flashattn.varlen_attention is not supported")
    _refuse_batched_mods(in_dims[9:])
    n = info.batch_size
    tensors = (_folded(t, d, n) for t, d in zip((q, k, v, o, lse2, do, dlse), in_dims[:7]))
    grads = torch.ops.flashattn.backward(*tensors, is_causal, scale, *_repeated_mods(variants, n))
    return tuple(_unfolded(g, n) for g in grads), (0, 0, 0)


def _repeated_mods(variants, n):
    """The operators' variant arguments with the mask and the slopes following q's batch once vmap's
    ``n`` copies are folded into it: a batch dim of 1 stays a stride-0 view, a full one is repeated
    ``n`` times (the folded batch is vmap's index times the batch, plus the batch element)."""
    variants = list(variants)
    for i in (7, 8):  # alibi_slopes (B or 1, H), attn_mask (B or 1, ...)
        # (arguments at their defaults may reach the rule left out)
        t = variants[i] if i < len(variants) else None
        if t is not None and t.shape[0] != 1:
            variants[i] = t.unsqueeze(0).expand(n, *t.shape).reshape(n * t.shape[0], *t.shape[1:])
    return variants


def _refuse_batched_mods(variant_dims):
    # The mask and the slopes are indexed by (batch, head) in the kernels: a vmapped one would
    # need folding like q's; not done.
    if any(d is not None for d in variant_dims):
        raise NotImplementedError("torch.func.vmap over attn_mask or alibi_slopes of flashattn.attention "
                                  "is not supported (vmap over q, k and v is)")
