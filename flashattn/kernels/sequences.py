"""Packed sequences as the kernels see them: the lengths, and the launch tables built from them.

A packed batch (``flashattn.varlen_attention``) puts sequences of different lengths end to end.
The kernels walk a table of programs, one entry ``(sequence, block)`` per query block (forward,
dQ) or key block (dK/dV) of every sequence, so no program is spent on padding; :class:`Sequences`
builds those tables from the lengths, longest work first.
"""
import numpy as np
import torch

from ..gpu import launcher


class Sequences:
    """A packed batch as the kernels see it: ``cu_seqlens_q``/``cu_seqlens_k`` on the device and
    the lengths on the host, from which :meth:`programs` builds the launch tables."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.lengths_q = np.asarray(lengths_q, dtype=np.int64)
        self.lengths_k = np.asarray(lengths_k, dtype=np.int64)
        self._tables = {}

    def config(self, name, dtype, constexprs):
        """The tiles kernel ``name`` runs with (a dict): the interpreter's, or the GPU's default."""
        return launcher.fixed_config(name, dtype, constexprs)

    def programs(self, side, block, win_left, win_right):
        """The launch table: an int32 tensor ``(programs, 2)`` of ``(sequence, block)``, one row
        per block of ``block`` queries (``side="q"``: forward, dQ) or keys (``side="kv"``: dK/dV)
        of every sequence, the blocks that visit the most tiles first. ``win_left``/``win_right``
        are the kernels' window bounds (``traversal.window_masking``), used to estimate the work."""
        key = (side, block, win_left, win_right)
        if key not in self._tables:
            own, other = (self.lengths_q, self.lengths_k) if side == "q" else (self.lengths_k, self.lengths_q)
            blocks = -(-own // block)
            sequence = np.repeat(np.arange(len(own)), blocks)
            first = np.repeat(np.cumsum(blocks) - blocks, blocks)
            index = np.arange(len(sequence)) - first                       # block within its sequence
            start = index * block
            # Rows of the other side visited: query block [s, s + block) sees keys from s - left to
            # s + block + right; key block [s, s + block) is seen by queries s - right .. s + block + left.
            before, after = (win_left, win_right) if side == "q" else (win_right, win_left)
            work = np.minimum(start + block + after, other[sequence]) - np.maximum(start - before, 0)
            order = np.argsort(-np.maximum(work, 0), kind="stable")
            table = np.stack([sequence[order], index[order]], axis=1).astype(np.int32)
            self._tables[key] = torch.from_numpy(table).to(self.cu_seqlens_q.device)
        return self._tables[key]
