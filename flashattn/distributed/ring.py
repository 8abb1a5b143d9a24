"""``flashattn.distributed.ring_attention``: attention over a sequence split across the ranks of a
process group, its K/V shards passed around a ring.

Every rank holds the same positions of q, k and v (its shard, ``flashattn.distributed.layout``).
In ``world`` steps each rank sees every K/V shard once: at each step it posts the transfer of the
shard it holds to the next rank (and the receipt of the next one from the previous rank), computes
its block with the kernels while the bytes travel, merges the block's partial output into its
running state with the LSE (``merge``), then waits for the transfer. The backward walks the same
ring: the K/V shards travel again, and beside them the partial sums of their gradients dK and dV,
each rank adding its share before passing them on, until they arrive home.
"""
import math

import torch
import torch.distributed as dist

from ..gpu.runtime import kernel_dtype
from ..kernels.tiles import LOG2E
from ..ops.attention import check_inputs
from ..ops.autograd import natural_lse
from ..ops.dispatch import attention_backward, attention_forward
from .checks import agree, dtype_code, float_bits
from .layout import LAYOUTS, check_layout, chunks_per_rank, group_rank_and_size
from .merge import merge_partials
from .schedule import ring_blocks, source_rank


class Ring:
    """This rank's place in the ring of ``group``: it sends to rank ``rank + 1`` and receives from
    rank ``rank - 1`` (ranks of the group, turned into the global ranks point-to-point ops take)."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.world)

    def start(self, tensors):
        """Post the sends of ``tensors`` to the next rank and the receipts of as many tensors of
        the same shapes from the previous rank, all at once (``batch_isend_irecv``); returns a
        :class:`Transfer` at once, while the bytes travel. With one rank there is nothing to send:
        the tensors come back as they are."""
        if self.world == 1:
            return Transfer([], list(tensors))
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return Transfer(dist.batch_isend_irecv(ops), received, sent=tensors)


class Transfer:
    """Transfers in flight; :meth:`wait` returns the received tensors once they have arrived."""

    def __init__(self, requests, received, sent=()):
        self.requests, self.received = requests, received
        self.sent = sent  # the sent tensors must live until their transfer is done

    def wait(self):
        for request in self.requests:
            request.wait()
        self.sent = ()
        return self.received


def ring_forward(q, k, v, is_causal, scale, ring, layout):
    """The forward on this rank's (B, H, N_local, D) shards: ``(o, lse2)``, ``o`` in q's dtype and
    ``lse2`` the base-2 LSE of every query over the whole sequence."""
    chunk = q.shape[2] // chunks_per_rank(layout)
    lse_dtype = torch.float64 if kernel_dtype(q)[0].dtype == torch.float32 else torch.float32
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(ring.world):
        # -- post the next block's transfer first, so that it travels while this block computes
        transfer = ring.start(kv) if step + 1 < ring.world else None
        source = source_rank(ring.rank, step, ring.world)
        for block in ring_blocks(ring.rank, source, ring.world, layout, is_causal):
            qs, ks = block.q_slice(chunk), block.kv_slice(chunk)
            o_b, lse_b = attention_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], block.causal,
                                           scale, lse_dtype=lse_dtype)
            # -- merge the block's partial state into the running one (exact, with the LSE)
            o[:, :, qs], lse[:, :, qs] = merge_partials(o[:, :, qs], lse[:, :, qs], o_b, lse_b)
        if transfer is not None:
            kv = transfer.wait()
    return o.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, dlse, is_causal, scale, ring, layout):
    """The backward on this rank's shards: ``(dq, dk, dv)`` of the shards it holds. ``o`` and
    ``lse`` are the forward's merged output and base-2 LSE (what every block's gradient needs),
    ``dlse`` the gradient reaching the natural-log LSE, or None."""
    chunk = q.shape[2] // chunks_per_rank(layout)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    arriving = None  # the partial dK, dV of the block this rank holds next, from the previous rank
    for step in range(ring.world):
        transfer = ring.start(kv) if step + 1 < ring.world else None
        source = source_rank(ring.rank, step, ring.world)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # this rank's share of dK
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # and of dV, for the held block
        for block in ring_blocks(ring.rank, source, ring.world, layout, is_causal):
            qs, ks = block.q_slice(chunk), block.kv_slice(chunk)
            dq_b, dk_b, dv_b = attention_backward(
                q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], o[:, :, qs], lse[:, :, qs].contiguous(),
                do[:, :, qs], block.causal, scale, dlse=None if dlse is None else dlse[:, :, qs].contiguous())
            dq[:, :, qs] += dq_b
            dk[:, :, ks] += dk_b
            dv[:, :, ks] += dv_b
        if arriving is not None:  # -- add the shares of the ranks that held this block before
            dk_in, dv_in = arriving.wait()
            dk += dk_in
            dv += dv_in
        arriving = ring.start([dk, dv])  # -- and pass the sums on, with the block, to the next rank
        if transfer is not None:
            kv = transfer.wait()
    dk, dv = arriving.wait()  # after the last step, the sums of this rank's own block are home
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, is_causal, scale, ring, layout) -> (o, lse2)`` on (B, H, N_local, D)
    shards; differentiable in q, k, v and through ``lse2``."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, ring, layout):
        o, lse = ring_forward(q, k, v, is_causal, scale, ring, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale, ctx.ring, ctx.layout = is_causal, scale, ring, layout
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse2):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dlse = None if dlse2 is None else (dlse2 * LOG2E).to(torch.float32)
        dq, dk, dv = ring_backward(do, q, k, v, o, lse, dlse, ctx.is_causal, ctx.scale, ctx.ring, ctx.layout)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, is_causal=False, scale=None, group=None, layout="zigzag", *,
                   enable_gqa=False, return_lse=False):
    """Attention over a sequence split across the ranks of ``group``, computed as a ring.

    Every rank calls it with its own shards, ``(B, H, N_local, D)`` for q and ``(B, H_kv, N_local,
    D)`` for k and v, the same positions for all three (``flashattn.distributed.shard`` cuts
    them from the whole tensors), and gets its shard of the output: the rows of
    ``flashattn.attention`` over the whole sequence of ``world * N_local`` positions that its
    queries hold. Differentiable in q, k and v.

    Args:
        is_causal: query ``i`` sees keys ``0..i`` of the whole sequence.
        scale: the factor applied to ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        group: the process group (None: the default one); its ranks form the ring in rank order.
        layout: which positions each rank holds, ``"zigzag"`` (chunks ``r`` and ``2w - 1 - r`` of
            ``2w``: under ``is_causal`` every rank does the same work) or ``"contiguous"`` (chunk
            ``r`` of ``w``). It must be the layout the shards were cut in.
        enable_gqa: K/V with fewer heads than q, as in ``flashattn.attention``.
        return_lse: also return the rank's rows of the natural-log LSE, ``(B, H, N_local)``.

    Dtypes float16, bfloat16 and float32, as ``flashattn.attention``. Every rank must call it
    with the same settings and shards of the same shapes; the ranks check that together first
    (one all-gather of a few integers per call) so that a wrong argument on any rank raises a
    TypeError or ValueError on every rank instead of a hang. Works with gloo on CPUs (Triton's
    interpreter) and NCCL on GPUs (set each rank's GPU with ``torch.cuda.set_device`` first, as
    NCCL's point-to-point operations need). No double backward.
    """
    group_rank_and_size(group)  # a process group must exist (and ``group`` be one)
    error = None
    try:
        check_inputs(q, k, v, is_causal, scale, return_lse, enable_gqa)
        check_layout(layout)
        _check_shards(q, k, v, layout)
    except (TypeError, ValueError) as e:
        error = e
    ok = error is None
    scale = (1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)) if ok else 0.0
    grad = ok and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    agree(group, error, {
        "q's shape": tuple(q.shape) if ok else (), "k's shape": tuple(k.shape) if ok else (),
        "v's shape": tuple(v.shape) if ok else (), "q's dtype": (dtype_code(q.dtype),) if ok else (),
        "is_causal": (int(bool(is_causal)),) if ok else (), "scale": (float_bits(scale),) if ok else (),
        "layout": (LAYOUTS.index(layout),) if ok else (), "enable_gqa": (int(bool(enable_gqa)),) if ok else (),
        "whether a gradient is needed": (int(grad),) if ok else ()})
    o, lse2 = RingAttention.apply(q, k, v, bool(is_causal), scale, Ring(group), layout)
    return (o, natural_lse(lse2)) if return_lse else o


def _check_shards(q, k, v, layout):
    """The shard shapes the ring needs, or a ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, N_local, D) shard, 4 dims; got shape {tuple(t.shape)}")
    if v.shape[-1] != q.shape[-1]:  # the ring's merged output and its transfers hold one head dim
        raise ValueError(f"v has head dim {v.shape[-1]} but q has {q.shape[-1]}: ring_attention needs them "
                         "equal (flashattn.attention takes a v of its own head dim)")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q holds {q.shape[2]} positions but k holds {k.shape[2]}: every rank's shards "
                         "of q, k and v must be the same positions of the sequence")
    n = q.shape[2]
    per_rank = chunks_per_rank(layout)
    if n == 0 or n % per_rank:
        raise ValueError(f"q holds {n} positions: layout={layout!r} gives each rank {per_rank} equal "
                         f"chunk(s), so a positive multiple of {per_rank} (cut the whole sequence into "
                         f"{per_rank} x world equal chunks, e.g. with flashattn.distributed.shard)")
