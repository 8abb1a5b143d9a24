"""Sequences packed in the rows of a batch, as transformers hands them to an attention function:
their lengths from FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k`` keywords or from
``position_ids`` that restart (read on the host once per forward, not per layer), and the
``cu_seqlens`` that ``flashattn.varlen_attention`` takes."""
import weakref

import torch


def packed_lengths(kwargs, batch, n_q, n_k, tracing=False):
    """``(lengths_q, lengths_k)`` of the sequences packed in the batch's rows, from
    FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k`` or from ``position_ids`` restarting in a
    batch of one row; None when each row is one sequence. ``position_ids`` are read once per
    tensor (:data:`POSITIONS`: the layers of a forward share them), never for several rows (a
    synchronisation in every layer of every step, where transformers' masks find packed rows
    themselves) and not while tracing (transformers puts packed sequences into its 4-D mask then)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        cu_k = cu_q if cu_k is None else cu_k
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        return ([b - a for a, b in zip(bounds_q, bounds_q[1:])],
                [b - a for a, b in zip(bounds_k, bounds_k[1:])])
    position_ids = kwargs.get("position_ids")
    if tracing or position_ids is None or batch != 1 or n_q != n_k or n_q < 2 \
            or tuple(position_ids.shape) != (1, n_q):
        return None
    lengths = POSITIONS.read(position_ids, sequence_lengths)
    return None if lengths is None else (lengths, lengths)


def sequence_lengths(positions):
    """The lengths of the sequences packed in the row of ``positions`` ``(1, N)``, or None when
    it holds one (read on the host). A sequence starts where the position does not follow the
    previous one, as transformers finds packed sequences."""
    sequence_ids = (positions.diff(dim=1, prepend=positions[:, :1] - 1) != 1).cumsum(1)
    if not bool(sequence_ids[:, -1].any()):
        return None
    return run_lengths(sequence_ids)


class LastRead:
    """The last value read on the host from a tensor, found again by the tensor itself (held
    weakly) while its version is unchanged: every layer of a forward gets the same tensor, which is
    then read once for all of them. An inference tensor (``torch.inference_mode``) keeps no version,
    so that a change in place would go unseen: it is read every time."""

    def __init__(self):
        self._entry = (None, None, None)

    def read(self, tensor, read):
        """``read(tensor)``, or what it gave for this very tensor last time."""
        if tensor.is_inference():
            return read(tensor)
        ref, version, value = self._entry
        if ref is None or ref() is not tensor or version != tensor._version:
            value = read(tensor)
            self._entry = (weakref.ref(tensor), tensor._version, value)
        return value


#: The sequences of the last ``position_ids`` read (:func:`packed_lengths`).
POSITIONS = LastRead()


def run_lengths(sequence_ids):
    """The lengths of the runs of equal ids in each row of ``sequence_ids`` ``(B, N)``, row after
    row (read on the host)."""
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    bounds = starts.reshape(-1).nonzero().flatten().tolist() + [sequence_ids.numel()]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def cumulative(lengths, device):
    """``cu_seqlens`` (int32) of sequences of the given lengths."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
