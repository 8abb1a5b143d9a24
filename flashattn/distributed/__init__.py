"""Context parallelism: attention over a sequence too long for one GPU, split across the ranks of
a torch.distributed process group, its K/V shards passed around a ring (ring attention).

    from flashattn.distributed import ring_attention, shard, unshard
    q_local, k_local, v_local = (shard(t, layout="zigzag") for t in (q, k, v))   # this rank's positions
    out_local = ring_attention(q_local, k_local, v_local, is_causal=True)        # differentiable
    out = unshard(out_local)                                                      # the whole output

``layout`` says which positions each rank holds (``layout``); ``schedule`` which K/V block each
rank holds at each step of the ring and what it computes with it; ``merge`` merges the partial
outputs with the LSE; ``ring`` runs the ring (point-to-point transfers overlapping the kernels)
forward and backward; ``checks`` has the ranks check their arguments together, so that a mistake
raises on every rank instead of hanging; ``launch`` runs a function on local processes that form
a group (gloo on the CPU, NCCL with a GPU per rank). Under torchrun, call ``ring_attention``
directly.
"""
from .launch import launch
from .layout import join_shards, positions, rank_chunks, shard, split_shards, unshard
from .ring import ring_attention

__all__ = ["ring_attention", "shard", "unshard", "launch", "split_shards", "join_shards", "rank_chunks",
           "positions"]
