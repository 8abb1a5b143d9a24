"""Checkers of chapter 13 (context parallelism): which positions a rank holds in the zigzag layout,
and which parts of a ring step a rank computes under the causal mask."""
import numpy as np
import torch

from ...distributed.layout import positions
from ...distributed.schedule import Block, covered, visible
from .common import ExerciseError, attempt, passed

#: (world, n) of the sequences the positions are checked on.
POSITION_CASES = [(1, 4), (2, 8), (2, 12), (3, 18), (4, 32), (8, 48)]


def _zigzag_variant(rank, world, n, variant):
    """The positions rank ``rank`` holds by a known mistake, to name it when a learner makes it."""
    chunk = n // (2 * world)
    first, second = rank, 2 * world - 1 - rank
    if variant == "off by one":
        second = 2 * world - rank
    elif variant == "contiguous":
        return list(range(rank * (n // world), (rank + 1) * (n // world)))
    elif variant == "chunks of n / world":
        chunk = n // world
    spans = [range(c * chunk, (c + 1) * chunk) for c in (first, second)]
    if variant == "later chunk first":
        spans = spans[::-1]
    if variant == "one chunk":
        spans = spans[:1]
    return [p for span in spans for p in span]


POSITION_HINTS = {
    "off by one": "the second chunk is one too far: of the 2 * world chunks, numbered 0 to 2 * world - 1, "
                  "the one that mirrors chunk r from the end is 2 * world - 1 - r.",
    "contiguous": "these are the positions of the contiguous layout (chunk r of world chunks). Zigzag cuts the "
                  "sequence into 2 * world chunks and gives rank r chunks r and 2 * world - 1 - r.",
    "chunks of n / world": "the chunks are too long: there are 2 * world of them, n // (2 * world) positions each.",
    "later chunk first": "the chunks are in the wrong order: a shard holds its chunks in increasing position, "
                         "chunk r first, then chunk 2 * world - 1 - r.",
    "one chunk": "only chunk r: a zigzag shard also holds the chunk that mirrors it from the end, "
                 "2 * world - 1 - r.",
}


def check_zigzag_positions(zigzag_positions):
    """Chapter 13: ``zigzag_positions(rank, world, n)`` must return the positions of a sequence of
    ``n`` that rank ``rank`` of ``world`` holds in the zigzag layout, in the order of its shard (a
    1-D tensor or a list of ints)."""
    name = getattr(zigzag_positions, "__name__", "zigzag_positions")
    for world, n in POSITION_CASES:
        for rank in range(world):
            where = f"{name}(rank={rank}, world={world}, n={n})"
            got = attempt(zigzag_positions, rank, world, n, name=name, forbid=("flashattn",))
            try:
                got = [int(p) for p in (got.tolist() if isinstance(got, torch.Tensor) else got)]
            except (TypeError, ValueError):
                raise ExerciseError(f"{where} should return a 1-D tensor or a list of ints, got "
                                    f"{type(got).__name__}") from None
            want = positions(rank, world, n).tolist()
            if got == want:
                continue
            for variant, hint in POSITION_HINTS.items():
                if got == _zigzag_variant(rank, world, n, variant) != want:
                    raise ExerciseError(f"{where} returned {_short(got)}: {hint}")
            if len(got) != n // world:
                raise ExerciseError(f"{where} returned {len(got)} positions: each of the {world} rank(s) holds "
                                    f"n / world = {n // world} of them")
            raise ExerciseError(f"{where} returned {_short(got)}, expected {_short(want)}")
    passed(f"{name} gives every rank its two chunks, r and 2 * world - 1 - r, for {len(POSITION_CASES)} "
           "sequences on 1 to 8 ranks")


def _short(values, most=12):
    if len(values) <= most:
        return str(values)
    return f"[{', '.join(map(str, values[:most]))}, ...] ({len(values)} in all)"


# --- Exercise 2: the blocks of a ring step -----------------------------------------------------------

CASE_HINTS = {
    "own": "At step 0 (source == rank) the rank holds its own K/V: the same positions as its queries, in "
           "increasing order, so the causal mask on the shard's own positions is the causal mask of the "
           "whole sequence (one call with causal=True on everything).",
    "before": "When the source comes first (source < rank), its chunk `source` lies before both of this "
              "rank's chunks and its chunk 2w - 1 - source after both: every query sees all of the first "
              "half of the keys and none of the second.",
    "after": "When the source comes later (source > rank), both of its chunks lie after this rank's chunk "
             "`rank` and before its chunk 2w - 1 - rank: the second half of the queries sees every key, the "
             "first half none.",
}


def _blocks(got, where):
    """The learner's list of (q_chunks, kv_chunks, causal) as Blocks, or a clear error."""
    shape = ("should return a list of (q_chunks, kv_chunks, causal) with q_chunks and kv_chunks pairs "
             "(lo, hi) of chunk indices 0, 1 or 2 of the shards, lo < hi")
    if not isinstance(got, (list, tuple)):
        raise ExerciseError(f"{where} {shape}; got {type(got).__name__}")
    blocks = []
    for item in got:
        try:
            (q_lo, q_hi), (kv_lo, kv_hi), causal = item
            q_lo, q_hi, kv_lo, kv_hi = (int(x) for x in (q_lo, q_hi, kv_lo, kv_hi))
        except (TypeError, ValueError):
            raise ExerciseError(f"{where} {shape}; got {got!r}") from None
        if not (0 <= q_lo < q_hi <= 2 and 0 <= kv_lo < kv_hi <= 2):
            raise ExerciseError(f"{where} returned the block {item!r}: {shape}")
        if not isinstance(causal, (bool, np.bool_)):
            raise ExerciseError(f"{where} returned the block {item!r}: causal must be True or False")
        blocks.append(Block((q_lo, q_hi), (kv_lo, kv_hi), bool(causal)))
    return blocks


def check_zigzag_blocks(zigzag_blocks):
    """Chapter 13: ``zigzag_blocks(rank, source, world)`` must return the kernel calls that rank
    ``rank`` makes under the causal mask against the K/V shard of rank ``source``, with the zigzag
    layout: a list of ``(q_chunks, kv_chunks, causal)``, each ``(lo, hi)`` a range of the two chunks
    of a shard (0 and 1), ``causal`` for the kernel's top-left causal mask. Together they must
    compute every score the causal mask of the whole sequence shows, once, and nothing else."""
    name = getattr(zigzag_blocks, "__name__", "zigzag_blocks")
    chunk, calls = 3, 0
    for world in range(1, 6):
        for rank in range(world):
            for source in range(world):
                where = f"{name}(rank={rank}, source={source}, world={world})"
                blocks = _blocks(attempt(zigzag_blocks, rank, source, world, name=name, forbid=("flashattn",)),
                                 where)
                calls += len(blocks)
                got = covered(blocks, 2 * chunk, chunk)
                want = visible(rank, source, world, "zigzag", chunk).astype(np.int64)
                if np.array_equal(got, want):
                    continue
                hint = CASE_HINTS["own" if source == rank else "before" if source < rank else "after"]
                q_pos = positions(rank, world, 2 * world * chunk).tolist()
                k_pos = positions(source, world, 2 * world * chunk).tolist()
                for kind, mask in (("computes a score the causal mask hides", (got > 0) & (want == 0)),
                                   ("computes a score twice", got > 1),
                                   ("never computes a score the query sees", (got == 0) & (want == 1))):
                    if mask.any():
                        i, j = (int(x) for x in np.argwhere(mask)[0])
                        raise ExerciseError(
                            f"{where} {kind}: query position {q_pos[i]} against key position {k_pos[j]} (with "
                            f"chunks of {chunk} positions: query {i} of the rank's shard, key {j} of the held "
                            f"one). {hint}")
    passed(f"{name} computes every visible score once and nothing else, for every rank and source on 1 to 5 "
           f"ranks ({calls} kernel calls in all)")
