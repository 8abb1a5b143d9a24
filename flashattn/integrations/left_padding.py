"""A left-padded batch decoded in place: which batches have the left-padding form, and where each
sequence's keys start, computed on the device.

A padded batch's 2-D mask ``(B, N)`` (True for a token, False for padding) has the *left-padding
form* when each row is zeros, then ones: the padding before the tokens, as batched generation pads
its prompts and then appends one token per step to every row. The keys of sequence ``b`` in a KV
cache are then the entries ``leftpad[b] .. L - 1``, and ``flashattn.decode(...,
cache_leftpad=leftpad, max_seqlen=...)`` attends them where they lie: no gather of the cache, and
nothing read on the host, so that a decoding step waits for nothing and can be captured in a CUDA
graph.

Whether a batch has the form is read on the host once, at the batch's first call (its prefill,
whose mask covers its queries alone), and remembered per model (:class:`Batches`). Its later calls
(the decoding steps) are predicted to keep it, as generation keeps it, and held to it on the device:
:func:`first_keys` checks each step's mask with ``torch._assert_async``, which stops the program
(on a GPU at its next synchronisation) rather than let a mask outside the form be computed as if it
were in it. A batch whose first mask is not in the form takes the general path all along.
"""
import weakref

import torch

#: What a step whose mask broke the form is told (on the CPU; a GPU reports a device-side assert
#: with it, and CUDA's take at most 255 characters).
BROKEN_FORM = ("flashattn transformers integration: this mask has a zero after a one, outside the left-padding "
               "form (zeros, then ones) of its batch's first call, which decodes with cache_leftpad; keep one "
               "mask form per batch")


def has_form(mask):
    """Whether the 2-D mask ``(B, N)`` has the left-padding form: no zero after a one (read on the
    host: a synchronisation on a GPU)."""
    mask = mask.bool()
    return bool((mask | (mask.cumsum(-1) == 0)).all())


def first_keys(mask, seqlens=None):
    """The index of each row's first valid key, int32 ``(B,)``, on the mask's device: the number
    of zeros before its first one (at most ``seqlens``, the entries a row holds, when given), and
    the check that holds the mask to the left-padding form over those entries, without reading
    anything on the host. ``mask`` ``(B, N)``, bool; ``seqlens`` int ``(B,)`` or None (all N)."""
    before = mask.cumsum(-1) == 0                      # the leading padding
    inside = mask | before
    leftpad = before.sum(-1)
    if seqlens is not None:                            # entries past a row's length do not count
        slots = torch.arange(mask.shape[-1], device=mask.device)
        inside = inside | (slots >= seqlens[:, None])
        leftpad = torch.minimum(leftpad, seqlens)
    torch._assert_async(inside.all(), BROKEN_FORM)
    return leftpad.to(torch.int32)


class Batches:
    """Per model (its configuration object), the form of its batch's mask as read at the batch's
    first call: ``(batch size, device, form)``. A weak reference tells a configuration that is gone
    (and whose ``id`` another took) from the one remembered."""

    def __init__(self):
        self._seen = {}

    def remember(self, owner, mask):
        """Read ``mask``'s form on the host (once per batch: at its first call) and keep it for
        ``owner``; return it."""
        form = has_form(mask)
        if owner is not None:
            self._seen[id(owner)] = (weakref.ref(owner), mask.shape[0], mask.device, form)
            for key in [key for key, entry in self._seen.items() if entry[0]() is None]:
                del self._seen[key]
        return form

    def forget(self, owner):
        """Forget ``owner``'s batch (a new one whose form is not read); return False."""
        self._seen.pop(id(owner), None)
        return False

    def predicts_form(self, owner, mask):
        """Whether ``owner``'s batch, first seen in the left-padding form with as many rows on the
        same device as ``mask``, is predicted to keep it (False when nothing is known)."""
        entry = self._seen.get(id(owner)) if owner is not None else None
        return (entry is not None and entry[0]() is owner and entry[1] == mask.shape[0]
                and entry[2] == mask.device and entry[3])


class Spans:
    """The masks a mask function answered where ``flashattn.decode`` may attend the cached keys in
    place, each with ``(cache_leftpad, cache_seqlens, pattern)``: found again by the mask object
    itself (held weakly), so that the answer stays a plain tensor (a subclass would not pass
    through torch.compile, where generate may hand it)."""

    def __init__(self):
        self._by_id = {}

    def add(self, mask, cache_leftpad, cache_seqlens, pattern):
        """Remember ``mask``'s span; return ``mask``."""
        key = id(mask)
        forget = lambda _, key=key: self._by_id.pop(key, None)  # noqa: E731  (when the mask is gone)
        self._by_id[key] = (weakref.ref(mask, forget), cache_leftpad, cache_seqlens, pattern)
        return mask

    def of(self, mask):
        """``(cache_leftpad, cache_seqlens, pattern)`` of a mask answered with a span, else None."""
        entry = self._by_id.get(id(mask))
        return None if entry is None or entry[0]() is not mask else entry[1:]
