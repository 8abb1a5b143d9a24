"""The ring's schedule: which K/V block each rank holds at each step, what it computes with it,
and how much work that is, in plain Python.

At step ``t`` of ``world`` steps, rank ``r`` holds the K/V shard that rank ``(r - t) % world``
started with (each step every rank passes what it holds to rank ``r + 1``). Against it, rank ``r``
computes attention for some of its queries: :func:`ring_blocks` says which, as kernel calls on
slices of the two shards. Without a mask every query sees every key: one full call. Under the
causal mask, in chunks of positions, a key chunk before a query chunk is seen whole (full), the
same chunk is the causal diagonal, and a later one is not seen at all (skipped).

The ring itself (``flashattn.distributed.ring``) runs these calls; the pictures and the counts of
chapter 13 come from the same functions.
"""
from dataclasses import dataclass

import numpy as np

from ..kernels import traversal
from .layout import chunks_per_rank, rank_chunks


@dataclass(frozen=True)
class Block:
    """One kernel call of a ring step: the rank's query chunks ``[q[0], q[1])`` (chunk indices in
    its own shard) against the held K/V shard's chunks ``[kv[0], kv[1])``, with the causal mask
    aligned top-left (``causal``) or without a mask."""
    q: tuple
    kv: tuple
    causal: bool

    def q_slice(self, chunk):
        """The queries of the call, as a slice of the rank's shard, with chunks of ``chunk``
        positions."""
        return slice(self.q[0] * chunk, self.q[1] * chunk)

    def kv_slice(self, chunk):
        """The keys and values of the call, as a slice of the held shard."""
        return slice(self.kv[0] * chunk, self.kv[1] * chunk)


def source_rank(rank, step, world):
    """The rank whose K/V shard rank ``rank`` holds at step ``step``."""
    return (rank - step) % world


def ring_blocks(rank, source, world, layout="zigzag", is_causal=True):
    """The kernel calls rank ``rank`` makes against the K/V shard of rank ``source``: a list of
    :class:`Block` (empty when the mask hides all of it).

    With the zigzag layout rank ``r`` holds chunks ``r`` and ``2w - 1 - r`` of ``2w``, and the
    source holds ``s`` and ``2w - 1 - s``:

    * ``s == r``: the same positions for queries and keys, in increasing order, so the causal mask
      on the shard's own positions is the causal mask of the whole sequence: one causal call;
    * ``s < r``: chunk ``s`` comes before both of the rank's chunks, chunk ``2w - 1 - s`` after
      both: every query against the first half of the keys, no mask;
    * ``s > r``: both of the source's chunks come after chunk ``r`` and before chunk
      ``2w - 1 - r``: the second half of the queries against every key, no mask.

    Each of the last two is half the work of a full block: every step costs every rank the same.
    """
    n = chunks_per_rank(layout)
    if not is_causal:
        return [Block((0, n), (0, n), False)]
    if source == rank:
        return [Block((0, n), (0, n), True)]
    if layout == "contiguous":
        return [Block((0, 1), (0, 1), False)] if source < rank else []
    if source < rank:
        return [Block((0, 2), (0, 1), False)]
    return [Block((1, 2), (0, 2), False)]


def visible(rank, source, world, layout, chunk, is_causal=True):
    """The brute-force truth the blocks must cover: a boolean array (the rank's queries, the
    source's keys) of which key each query sees in the whole sequence, from the positions."""
    q = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, world, layout)])
    k = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(source, world, layout)])
    return k[None, :] <= q[:, None] if is_causal else np.ones((q.size, k.size), dtype=bool)


def covered(blocks, n_local, chunk):
    """What the kernel calls ``blocks`` compute: a count array (queries, keys) of how many calls
    compute each score (1 everywhere the mask shows, 0 elsewhere, if the blocks are right)."""
    counts = np.zeros((n_local, n_local), dtype=np.int64)
    for b in blocks:
        qs, ks = b.q_slice(chunk), b.kv_slice(chunk)
        n_q, n_kv = qs.stop - qs.start, ks.stop - ks.start
        seen = np.tril(np.ones((n_q, n_kv), dtype=np.int64)) if b.causal else np.ones((n_q, n_kv), dtype=np.int64)
        counts[qs, ks] += seen
    return counts


def call_tiles(n_q, n_kv, causal, block_q, block_kv):
    """The tiles the forward kernel computes (full or masked) for one call of ``n_q`` queries
    against ``n_kv`` keys, with tiles of ``block_q`` x ``block_kv``."""
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, causal)
    return int((kinds != traversal.SKIPPED).sum())


def step_tiles(world, n, layout="zigzag", is_causal=True, block_q=16, block_kv=16):
    """The tiles each rank computes at each step, for a sequence of ``n`` positions: an int array
    (ranks, steps)."""
    chunk = n // (world * chunks_per_rank(layout))
    tiles = np.zeros((world, world), dtype=np.int64)
    for rank in range(world):
        for step in range(world):
            for b in ring_blocks(rank, source_rank(rank, step, world), world, layout, is_causal):
                qs, ks = b.q_slice(chunk), b.kv_slice(chunk)
                tiles[rank, step] += call_tiles(qs.stop - qs.start, ks.stop - ks.start, b.causal, block_q, block_kv)
    return tiles


def rank_tiles(world, n, layout="zigzag", is_causal=True, block_q=16, block_kv=16):
    """The tiles each rank computes over the whole ring (a list, rank by rank). The ring ends no
    sooner than its busiest rank: the largest of these sets its time."""
    return step_tiles(world, n, layout, is_causal, block_q, block_kv).sum(axis=1).tolist()
