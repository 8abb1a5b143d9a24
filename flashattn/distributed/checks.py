"""Checking the arguments of a call that every rank makes together, without ever hanging.

A rank that raised on its own while the others went on to send it their K/V would leave them
waiting forever, and ranks called with shards of different sizes would exchange buffers that do
not fit. So every rank first checks its own arguments, then all ranks exchange what they found
(one small all-gather of integers) and decide together: a rank whose arguments are wrong raises
its own error, every other rank an error naming it, and arguments that differ between ranks are
named with each rank's value. Only then does the ring start.
"""
import struct
import zlib

import torch
import torch.distributed as dist

#: Each fact travels as its length and up to this many integers.
MAX_FACT = 8


def gather_device(group):
    """Where the all-gather's tensor must live: the current GPU for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def float_bits(x):
    """A float as one int64 (its IEEE bits), so that it travels with the integers exactly."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def agree(group, error, facts):
    """Every rank of ``group`` calls this with its own ``error`` (an exception its local checks
    raised, or None) and the same names in ``facts`` (name -> tuple of at most MAX_FACT ints). It
    returns only when every rank is fine and the facts agree; otherwise it raises, on every rank:
    the rank's own error where it has one, else a ValueError naming the ranks that refused, or the
    first fact that differs with every rank's value."""
    names = list(facts)  # the same order on every rank: the same code builds it
    too_long = [name for name in names if len(facts[name]) > MAX_FACT]
    if error is None and too_long:  # refused like any other local error: after the gather
        error = ValueError(f"{too_long[0]} has {len(facts[too_long[0]])} entries, more than {MAX_FACT}")
    row = [0 if error is not None else 1]
    for name in names:
        values = () if error is not None else tuple(int(v) for v in facts[name])
        row += [len(values), *values, *([0] * (MAX_FACT - len(values)))]
    world = dist.get_world_size(group)
    mine = torch.tensor(row, dtype=torch.int64, device=gather_device(group))
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()
    refused = [r for r in range(world) if table[r][0] == 0]
    if error is not None:
        raise error
    if refused:
        raise ValueError(f"rank(s) {refused} of {world} refused their arguments (see the error there); "
                         "every rank must call with valid arguments")
    for i, name in enumerate(names):
        start = 1 + i * (MAX_FACT + 1)
        seen = [tuple(r[start + 1:start + 1 + r[start]]) for r in table]
        if len(set(seen)) > 1:
            each = ", ".join(f"rank {r}: {_shown(name, v)}" for r, v in enumerate(seen))
            raise ValueError(f"{name} differs between the ranks ({each}); every rank must call with the "
                             "same settings and shards of the same size")


def _shown(name, values):
    """A fact as the error message shows it: a shape as a tuple, a dtype by its name, a float
    as a float."""
    if "shape" in name:
        return tuple(values)
    if len(values) != 1:
        return tuple(values)
    if name.endswith("dtype"):
        return next((str(d) for d in _DTYPES if dtype_code(d) == values[0]), values[0])
    if name == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", values[0]))[0])
    return values[0]


def agree_on_shapes(group, tensors):
    """:func:`agree` on the shapes and dtypes of ``tensors`` (name -> tensor), as unshard needs:
    every rank's piece must have the same shape for the all-gather."""
    error, facts = None, {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            error = TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        ok = error is None and t.dim() <= MAX_FACT
        facts[f"{name}'s shape"] = tuple(t.shape) if ok else ()
        facts[f"{name}'s dtype"] = (dtype_code(t.dtype),) if ok else ()
    agree(group, error, facts)


def dtype_code(dtype):
    """An integer per dtype, the same on every rank (the CRC-32 of its name)."""
    return zlib.crc32(str(dtype).encode())


_DTYPES = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
