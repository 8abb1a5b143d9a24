"""Which positions of the sequence each rank holds: the two layouts, and moving tensors to them.

The sequence of ``N`` positions is cut into equal chunks of consecutive positions:

* **contiguous**: ``world`` chunks; rank ``r`` holds chunk ``r``. Simple, but under a causal mask
  the last rank's queries see every key and the first rank's see only their own chunk.
* **zigzag**: ``2 * world`` chunks; rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``, one
  from each end, so that every rank holds as many early as late queries (the layout of
  ring-flash-attention's zigzag variant, of Llama 3's context parallelism and of PyTorch's
  ``context_parallel``, which calls it head-tail).

A rank's shard is its chunks one after the other, in increasing position. :func:`split_shards`
and :func:`join_shards` do the cutting and the joining in one process; :func:`shard` and
:func:`unshard` do them for the rank that calls them, in a process group.
"""
import numbers

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout):
    """``layout`` itself, or a ValueError naming it."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")
    return layout


def chunks_per_rank(layout):
    """How many chunks each rank holds: 2 (zigzag) or 1 (contiguous)."""
    return 2 if check_layout(layout) == "zigzag" else 1


def rank_chunks(rank, world, layout="zigzag"):
    """The chunks rank ``rank`` of ``world`` holds, in increasing order: ``(rank, 2 * world - 1 -
    rank)`` for zigzag, ``(rank,)`` for contiguous."""
    if chunks_per_rank(layout) == 1:
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def chunk_size(n, world, layout="zigzag", name="the sequence"):
    """The length of one chunk when ``n`` positions are cut for ``world`` ranks, or a ValueError
    saying why ``n`` cannot be cut so."""
    if isinstance(world, bool) or not isinstance(world, numbers.Integral) or world < 1:
        raise ValueError(f"the world size must be an int >= 1, got {world!r}")
    count = world * chunks_per_rank(layout)
    if n % count or n == 0:
        raise ValueError(f"{name} has {n} positions, which layout={layout!r} cannot cut for {world} "
                         f"rank(s): it needs {count} equal chunks ({chunks_per_rank(layout)} per rank), "
                         f"so a length that is a positive multiple of {count}")
    return n // count


def positions(rank, world, n, layout="zigzag"):
    """The positions of the whole sequence (of length ``n``) that rank ``rank`` holds, in the order
    of its shard: a LongTensor of ``n // world`` positions."""
    size = chunk_size(n, world, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in rank_chunks(rank, world, layout)])


def split_shards(x, world, layout="zigzag", dim=-2):
    """Every rank's shard of the whole tensor ``x``, cut along ``dim``: a list of ``world`` new
    tensors, rank by rank."""
    dim = _dim(x, dim, "x")
    size = chunk_size(x.shape[dim], world, layout, name=f"x (dim {dim})")
    chunks = x.split(size, dim=dim)
    return [torch.cat([chunks[c] for c in rank_chunks(r, world, layout)], dim=dim) for r in range(world)]


def join_shards(shards, layout="zigzag", dim=-2):
    """The whole tensor back from every rank's shard (a list, rank by rank): the inverse of
    :func:`split_shards`."""
    world = len(shards)
    dim = _dim(shards[0], dim, "the shards")
    per_rank = chunks_per_rank(layout)
    if shards[0].shape[dim] % per_rank:
        raise ValueError(f"a shard holds {shards[0].shape[dim]} positions along dim {dim}: with "
                         f"layout={layout!r} it holds {per_rank} equal chunks")
    size = shards[0].shape[dim] // per_rank
    chunks = [None] * (world * per_rank)
    for r, piece in enumerate(shards):
        for c, part in zip(rank_chunks(r, world, layout), piece.split(size, dim=dim)):
            chunks[c] = part
    return torch.cat(chunks, dim=dim)


def _dim(x, dim, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def group_rank_and_size(group=None):
    """``(rank, world size)`` of this process in ``group`` (None: the default group), or a
    RuntimeError saying that torch.distributed has not been set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashattn.distributed needs a torch.distributed process group: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets up what it "
                           "needs), or run the function with flashattn.distributed.launch")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x, group=None, layout="zigzag", dim=-2):
    """This rank's shard of the whole tensor ``x`` (the same on every rank), cut along ``dim``
    (by default the sequence dim of a ``(B, H, N, D)`` tensor): a new tensor of ``N / world``
    positions, the chunks of :func:`rank_chunks` one after the other."""
    rank, world = group_rank_and_size(group)
    return split_shards(x, world, layout, dim)[rank]


def unshard(x_local, group=None, layout="zigzag", dim=-2):
    """The whole tensor from every rank's shard ``x_local`` (an all-gather): the inverse of
    :func:`shard`, returned on every rank. Not differentiable."""
    from .checks import agree_on_shapes  # the check gathers from every rank before any raises

    rank, world = group_rank_and_size(group)
    check_layout(layout)
    dim = _dim(x_local, dim, "x_local")
    agree_on_shapes(group, {"x_local": x_local})
    if chunks_per_rank(layout) == 2 and x_local.shape[dim] % 2:
        raise ValueError(f"x_local has {x_local.shape[dim]} positions along dim {dim}: a zigzag shard "
                         "holds two equal chunks, so an even number")
    pieces = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    return join_shards(pieces, layout, dim)
