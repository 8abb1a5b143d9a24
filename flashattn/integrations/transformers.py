"""Hugging Face transformers models on flashattn's kernels.

    import flashattn.integrations.transformers as fa_transformers
    name = fa_transformers.register()                   # "fa_triton"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

transformers looks up each layer's attention function by the name in ``attn_implementation``, in
its ``AttentionInterface``, and calls it with the query, key and value states ``(B, H, N, D)``
after the rotary embedding and the KV cache's update. The mask reaching that function is made by
the mask function registered under the same name in ``AttentionMaskInterface`` (:func:`layer_mask`),
from the pattern transformers describes (``mask_function``: causal, a sliding window, chunks,
image spans, any ``and_mask_function``/``or_mask_function``), the positions of the queries and
keys (``q_offset``, ``kv_offset``: a cache's) and the 2-D padding mask. It returns one of:

- None: a pattern the kernels place themselves (causal or not, a sliding window, chunks that hold
  every position), the newest key at the newest query's position (no cache, or a dynamic one),
  nothing padded;
- the 2-D padding mask ``(B, N_k)`` (True for a token, False for padding), same pattern;
- the sequence of each token (``SequenceIds``, int ``(B, N)``) where transformers found sequences
  packed in rows (``position_ids`` that restart): same pattern, within each sequence;
- a 4-D mask ``(B, 1, N_q, N_k)``, transformers' own (what ``sdpa`` gets) for everything else: a
  static cache (its unwritten slots and its queries' positions are known on the device only),
  chunked attention past the first chunk, bidirectional spans, custom overlays, any function of
  its own. It is exact by construction.
  (A name missing from the mask interface would get no mask at all: a padded batch would
  silently attend its padding.)

Where a causal layer's cached keys can be attended where they lie, the 2-D key mask (a dynamic
cache) or the 4-D mask (a static one) comes with a *span*, kept beside it (``Spans``: the answer
stays a plain tensor): each sequence's first valid key and the entries written so far, both on the
device. That holds for a batch without padding and for one whose 2-D mask has the left-padding form
(zeros, then ones: ``flashattn.integrations.left_padding``), which is read on the host once per
batch, at its first call (the prefill), and predicted for its later calls, each held to it by a
check on the device. A mask as wide as the layer's keys, which start past the first position, is
read as theirs (as transformers' FlashAttention path reads it): generate makes a static cache's
masks in advance and hands them back to the mask function.

What the attention function does with what it gets:

- a 4-D mask (that one, or a custom mask passed to the model): ``flashattn.attention`` with it as
  ``attn_mask``, and nothing else: the mask says which pairs take part, as in ``sdpa`` and
  ``eager`` (the layer's ``is_causal`` and ``sliding_window`` are in it);
- no mask, query as long as the keys: ``flashattn.attention``, causal, windowed, grouped heads as
  they come;
- ``position_ids`` that restart in a batch of one row (several sequences packed in it, as
  transformers' data collator for padding-free training makes them; read on the host once per
  forward, not per layer, and, as transformers' FlashAttention path does, only for one row: a batch
  of several rows is read nothing), or FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k``
  keywords: ``flashattn.varlen_attention`` over the sequences;
- a padding mask: the tokens are gathered into a packed batch (no padding), attended with
  ``varlen_attention`` and scattered back; padding rows of the output are 0. With a sliding
  window (counted, as transformers counts it, in the padded row), the mask goes to
  ``flashattn.attention`` as a key mask ``(B, 1, 1, N_k)`` beside the causal mask and window;
- a query shorter than its keys (a KV cache: generation, or a prompt fed in chunks): causal masking
  and sliding windows are aligned bottom-right, the last query seeing the last key
  (``causal_alignment="bottom_right"``; SDPA's ``is_causal`` and flashattn's default align them
  top-left). In a packed batch the alignment holds within each sequence, so a padded batch with a
  cache is one ``varlen_attention`` call. Without gradients or dropout, ``flashattn.decode``, made
  for this case, runs instead;
- a mask with a span, the query shorter than its keys, no gradients or dropout: ``flashattn.decode``
  on the cache in place, ``cache_leftpad`` and ``cache_seqlens`` from the span, ``max_seqlen`` the
  keys' count: no gather, no copy, nothing read on the host, so a decoding step waits for nothing
  and can be captured in a CUDA graph. Anything else takes the mask's path above.

Under ``torch.compile`` (and CUDA graph capture) nothing is read on the host: the padding mask goes
to ``flashattn.attention`` as a key mask ``(B, 1, 1, N_k)`` beside the causal mask and window,
``position_ids`` are not inspected (transformers then folds packed sequences into the 4-D mask
itself), and ``decode`` runs only in place with a span, which reads nothing (in a CUDA graph; a
step compiled by torch.compile, which does not trace decode, takes the mask's path). The mask
function recognises only the plain causal and bidirectional patterns then (the closure of a
function made in the graph cannot be read): a window or chunks come as the 4-D mask. Only
``cu_seq_lens_q``/``_k`` are still read, to size ``varlen_attention``'s launch.

transformers' sliding windows count the query itself: ``sliding_window=w`` lets query ``i`` see
keys ``i - w < j <= i``, which is FlashAttention's ``window_size=(w - 1, 0)``. A bidirectional
layer's ``sliding_window=w`` keeps ``|i - j| < w``, ``window_size=(w - 1, w - 1)``, as
transformers' FlashAttention path reads it (ModernBERT passes its half window plus one).

Attention sinks (``s_aux``, GPT-OSS's learned logit per head, one more score in every row's softmax
that no value follows) rescale whatever path ran from its ``(out, lse)``: :meth:`Call.finish`.
The sequences packed in rows are found by ``flashattn.integrations.packing``.
"""
import numbers

import torch

import flashattn

from . import left_padding, warn_if_untested
from .packing import cumulative, packed_lengths, run_lengths

try:
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers import masking_utils
except ImportError as error:  # the integration is optional: say how to get what it needs
    raise ImportError("flashattn.integrations.transformers needs Hugging Face transformers: "
                      'pip install "flashattn[transformers]"') from error

#: The oldest transformers the integration's tests ran with: how a cache, its offsets and the mask
#: function reach the attention changed before it.
OLDEST_TESTED = (5, 24)
warn_if_untested("transformers", transformers.__version__, OLDEST_TESTED)

#: The name registered by default. transformers reads any name containing "flash" as one of its
#: FlashAttention backends (and a name with a "/" as a kernel on the Hub), so it must avoid both.
DEFAULT_NAME = "fa_triton"


def register(name=None):
    """Register flashattn's attention (and its mask function) with transformers under ``name`` (by
    default ``DEFAULT_NAME``) and return the name to pass as ``attn_implementation``."""
    name = DEFAULT_NAME if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower() or "/" in name or name in ("eager", "sdpa", "flex_attention"):
        raise ValueError(f"name {name!r} is taken by transformers: a name containing 'flash' selects its "
                         "FlashAttention backends, one with '/' a kernel from the Hub, and eager, sdpa, "
                         "flex_attention are its own; choose another")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, layer_mask)
    return name


def tracing(tensor=None):
    """Whether a graph is being traced or captured (torch.compile, export, a CUDA graph), when
    nothing may be read on the host."""
    if torch.compiler.is_compiling():
        return True
    if tensor is not None and tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    return False


# -- The mask function ------------------------------------------------------------------------------

def layer_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, **kwargs):
    """transformers' mask function for this attention: None, the 2-D padding mask ``(B, N_k)``
    (bool), or transformers' own 4-D mask ``(B, 1, N_q, N_k)``, either mask perhaps with a span
    for decode in place (see the module's docstring).

    ``q_offset``/``kv_offset`` are the positions of the first query and key (ints, or a tensor for
    a static cache's queries); ``attention_mask`` the 2-D padding mask of every position so far,
    whose columns ``kv_offset .. kv_offset + N_k - 1`` are this layer's keys (missing columns are
    padding, as transformers reads them)."""
    if attention_mask is not None and attention_mask.dim() == 2 and isinstance(kv_offset, numbers.Integral) \
            and 0 < kv_offset and attention_mask.shape[-1] == kv_length:
        # A mask exactly as wide as the layer's keys, which start past the first position, is
        # theirs already, as transformers' FlashAttention path reads it: this function's 2-D
        # answer handed back (generate makes a static cache's masks in advance, then the model
        # asks again with what it got). Placed at the keys' columns, it is read as one.
        attention_mask = torch.nn.functional.pad(attention_mask.bool(), (kv_offset, 0), value=True)
    if mask_function is None:
        mask_function = masking_utils.causal_mask_function   # transformers' default
    pattern = pattern_of(mask_function)
    in_place = decodes_in_place(pattern, kwargs.get("config"), attention_mask, q_length)
    if pattern is not None and kernels_place(pattern, q_length, kv_length, q_offset, kv_offset):
        if in_place and attention_mask is not None and kv_length > q_length:
            mask = layer_columns(attention_mask, kv_length, kv_offset)   # every key written: all count
            every = torch.full((batch_size,), kv_length, dtype=torch.int32, device=mask.device)
            return SPANS.add(mask, left_padding.first_keys(mask), every, pattern)
        return padding_of(attention_mask, kv_length, kv_offset)
    packed = packed_pattern_of(mask_function)
    if packed is not None and attention_mask is None and q_length == kv_length and q_offset == kv_offset == 0 \
            and kernels_place(packed[1], q_length, kv_length, 0, 0) and packed[1][2] is None \
            and not tracing(packed[0]):
        return packed[0].as_subclass(SequenceIds)   # attended as packed sequences
    for name in ("allow_is_causal_skip", "allow_is_bidirectional_skip"):
        kwargs.pop(name, None)
    mask = masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                   attention_mask, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                                   **kwargs)
    seqlens = written_slots(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, mask.device)
    if in_place and seqlens is not None:
        # A static cache: the entries written so far, in place; the 4-D mask for any call decode
        # cannot take.
        leftpad = None if attention_mask is None else \
            left_padding.first_keys(layer_columns(attention_mask, kv_length, kv_offset), seqlens)
        return SPANS.add(mask.contiguous(), leftpad, seqlens, pattern)
    return mask


def decodes_in_place(pattern, config, attention_mask, q_length):
    """Whether a causal pattern's cached keys may be attended in place by ``flashattn.decode``
    (``cache_leftpad``, ``max_seqlen``): no padding, or a batch whose 2-D mask has the
    left-padding form. That form is read on the host at the batch's first call without gradients
    (the mask covers its queries alone: a prefill; decode takes no gradients) and predicted for
    its later calls, each held to it on the device (``flashattn.integrations.left_padding``).
    Never while compiling: torch.compile does not trace decode."""
    if pattern is None or not pattern[0] or torch.compiler.is_compiling():
        return False
    if attention_mask is None:
        return True
    if attention_mask.dim() != 2:
        return False
    if attention_mask.shape[-1] == q_length:   # the batch's first call: read once, or forget the last
        if torch.is_grad_enabled() or tracing(attention_mask):
            return BATCHES.forget(config)
        return BATCHES.remember(config, attention_mask)
    return BATCHES.predicts_form(config, attention_mask)


#: The form of each model's batch, as read at its first call; the masks answered with cached keys
#: that decode may attend in place.
BATCHES, SPANS = left_padding.Batches(), left_padding.Spans()


def written_slots(pattern, batch, q_length, kv_length, q_offset, kv_offset, device):
    """For a causal layer whose keys are a static cache's ``kv_length`` slots, the newest query at
    position ``q_offset + q_length - 1`` (``q_offset`` an int or, for a static cache, a tensor on
    the device): the slots written so far, int32 ``(B,)`` on the device. None for anything else."""
    if pattern is None or not pattern[0] or pattern[2] is not None or not isinstance(kv_offset, numbers.Integral):
        return None
    if isinstance(q_offset, torch.Tensor):
        if q_offset.numel() != 1 or q_offset.is_floating_point():
            return None
        written = (q_offset.reshape(1) + (q_length - kv_offset)).to(device=device, dtype=torch.int32)
    elif isinstance(q_offset, numbers.Integral) and 0 < q_offset + q_length - kv_offset < kv_length:
        written = torch.full((1,), q_offset + q_length - kv_offset, dtype=torch.int32, device=device)
    else:
        return None
    return written.expand(batch).contiguous()


def layer_columns(attention_mask, kv_length, kv_offset):
    """The 2-D padding mask of the layer's keys, bool ``(B, N_k)``, contiguous: columns
    ``kv_offset .. kv_offset + N_k - 1``, those past the mask being padding, as transformers reads
    them."""
    mask = attention_mask.bool()
    if mask.shape[-1] < kv_offset + kv_length:
        mask = torch.nn.functional.pad(mask, (0, kv_offset + kv_length - mask.shape[-1]), value=False)
    return mask[:, kv_offset:kv_offset + kv_length].contiguous()


class SequenceIds(torch.Tensor):
    """The mask function's answer for sequences packed in rows (``(B, N)``, int: the sequence of
    each token), told apart from a padding mask by its type."""


def pattern_of(mask_function):
    """``(causal, window, chunk)`` when ``mask_function`` is one of transformers' plain patterns:
    causal or bidirectional, with its sliding window or chunk size (else None), as
    ``masking_utils`` builds them. None for anything else (overlays, packed sequences, a function
    of its own): that is computed from the function itself, never guessed."""
    if mask_function is masking_utils.causal_mask_function:
        return True, None, None
    if mask_function is masking_utils.bidirectional_mask_function:
        return False, None, None
    parts = _closure_value(mask_function, "and_masks", "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    if base is masking_utils.causal_mask_function:
        window = _closure_value(overlay, "sliding_window_overlay", "sliding_window")
        if _is_size(window):
            return True, int(window), None
        chunk = _closure_value(overlay, "chunked_overlay", "chunk_size")
        if _is_size(chunk):
            return True, None, int(chunk)
    if base is masking_utils.bidirectional_mask_function:
        window = _closure_value(overlay, "sliding_window_bidirectional_overlay", "sliding_window")
        if _is_size(window):
            return False, int(window), None
    return None


def packed_pattern_of(mask_function):
    """``(sequence_ids, pattern)`` when ``mask_function`` is a plain pattern within sequences packed
    in rows, as transformers builds it from ``position_ids`` that restart: ``sequence_ids`` (int,
    ``(B, N)``) numbers each token's sequence. None otherwise."""
    parts = _closure_value(mask_function, "and_masks", "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    within, same_sequence = parts
    ids = _closure_value(same_sequence, "packed_sequence_mask_function", "packed_sequence_mask")
    base = _closure_value(within, "remap_positions_for_packed_sequence", "mask_function")
    pattern = None if base is None else pattern_of(base)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or pattern is None:
        return None
    return ids, pattern


def _closure_value(function, factory, name):
    """The variable ``name`` that ``masking_utils.<factory>`` closed ``function`` over, or None when
    ``function`` was not made by that factory (told by its code, which every function a factory
    makes shares). While compiling, None: the 4-D mask is made instead, exact as ever."""
    if torch.compiler.is_compiling():
        return None   # torch.compile cannot read the closure of a function made in its graph
    code = getattr(function, "__code__", None)
    if code is None or code is not _FACTORY_CODES[factory] or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def _made_by(factory):
    """A function made by ``masking_utils.<factory>`` (arguments that only build it)."""
    build = getattr(masking_utils, factory, None)
    if build is None:       # a transformers without it: nothing is recognised as its
        return None
    mask, ids = masking_utils.causal_mask_function, torch.zeros(1, 1, dtype=torch.int64)
    arguments = {"and_masks": (mask, mask), "sliding_window_overlay": (1,),
                 "sliding_window_bidirectional_overlay": (1,), "chunked_overlay": (1, ids[0]),
                 "packed_sequence_mask_function": (ids,), "remap_positions_for_packed_sequence": (mask, ids)}
    return build(*arguments[factory])


#: The code of the functions each factory makes, found once, at import (not while tracing).
_FACTORY_CODES = {factory: getattr(_made_by(factory), "__code__", None)
                  for factory in ("and_masks", "sliding_window_overlay", "sliding_window_bidirectional_overlay",
                                  "chunked_overlay", "packed_sequence_mask_function",
                                  "remap_positions_for_packed_sequence")}


def _is_size(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def kernels_place(pattern, q_length, kv_length, q_offset, kv_offset):
    """Whether the kernels place ``pattern`` themselves: the positions are known on the host and
    are those the kernels assume (the last query at the last key for a causal layer, the first
    query at the first key for a bidirectional window), and chunks, if any, hold every position."""
    causal, window, chunk = pattern
    if not all(isinstance(n, numbers.Integral) for n in (q_offset, kv_offset)):
        return False    # a static cache's queries: their positions are on the device
    if causal:
        # Chunks of ``chunk`` positions all in the first one: plain causal attention.
        return q_offset + q_length == kv_offset + kv_length and (chunk is None or kv_offset + kv_length <= chunk)
    return window is None or q_offset == kv_offset


def padding_of(attention_mask, kv_length, kv_offset):
    """The 2-D padding mask of the layer's keys (bool), or None when nothing is padded (read on the
    host; while tracing it cannot be, and the mask is returned as it is)."""
    if attention_mask is None:
        return None
    mask = layer_columns(attention_mask, kv_length, kv_offset)
    if not tracing(mask) and bool(mask.all()):
        return None
    return mask


# -- The attention function -------------------------------------------------------------------------

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention function: ``(B, H_q, N_q, D)`` queries against ``(B, H_kv, N_k, D)``
    keys and values; returns ``(out, None)`` with ``out`` of shape ``(B, N_q, H_q, D)`` (no
    attention weights: they are never formed)."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("flashattn's transformers integration does not support position_bias (a "
                                  "learned additive bias, as T5's); use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("flashattn never forms the attention weights (output_attentions=True); "
                                  "use attn_implementation='eager'")
    batch, heads_q, n_q, _ = query.shape
    heads_kv, n_k = key.shape[1], key.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"the query has {heads_q} heads and the keys {heads_kv}: the query heads must be "
                         "a multiple of the key heads")
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"s_aux (the attention sinks) has shape {tuple(sinks.shape)}; expected one logit per "
                         f"query head, ({heads_q},)")
    options = dict(scale=scaling, dropout=float(dropout or 0.0), softcap=softcap, gqa=heads_q != heads_kv,
                   tracing=tracing(query), sinks=sinks)
    span = None if attention_mask is None or torch.compiler.is_compiling() else SPANS.of(attention_mask)
    if span is not None:
        out = in_place(module, query, key, value, attention_mask, span, options, is_causal, sliding_window)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.dim() == 4:
        # The whole pattern, as sdpa and eager take it: nothing else applies.
        call = Call(causal=False, window=(-1, -1), **options)
        return call.masked(query, key, value, attention_mask).transpose(1, 2).contiguous(), None

    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if causal and n_q > n_k:
        raise ValueError(f"a causal layer got {n_q} queries but only {n_k} keys: a query's own key "
                         "must be among the keys")
    call = Call(causal=causal, window=window_of(sliding_window, causal), **options)
    if isinstance(attention_mask, SequenceIds):
        lengths = run_lengths(attention_mask.as_subclass(torch.Tensor))
        q, k, v = (t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3]) for t in (query, key, value))
        out = call.packed(q, k, v, lengths, lengths).view(batch, n_q, heads_q, value.shape[-1])
        return out.contiguous(), None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("flashattn's attention takes the 2-D padding mask or the 4-D mask of its mask "
                             f"function; got a mask of shape {tuple(attention_mask.shape)}")
        if attention_mask.shape[1] != n_k:
            raise ValueError(f"the padding mask has {attention_mask.shape[1]} columns but the layer holds "
                             f"{n_k} keys; they must be equal")
        if call.tracing or call.window != (-1, -1):
            # The key mask beside the causal mask and the window, at the tokens' places in the
            # padded rows, where transformers counts a window (packed, the tokens' places would
            # move: exact only without a window). Nothing is read on the host.
            keys = attention_mask.to(device=query.device, dtype=torch.bool)[:, None, None, :]
            out = call.masked(query, key, value, keys).transpose(1, 2)
        else:
            out = padded(call, *(t.transpose(1, 2) for t in (query, key, value)), attention_mask)
        return out.contiguous(), None
    lengths = packed_lengths(kwargs, batch, n_q, n_k, call.tracing)
    if lengths is not None:
        q, k, v = (t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3]) for t in (query, key, value))
        out = call.packed(q, k, v, *lengths).view(batch, n_q, heads_q, value.shape[-1])  # v: its head dim
    else:
        out = call.dense(query, key, value).transpose(1, 2)
    return out.contiguous(), None


def in_place(module, query, key, value, mask, span, options, is_causal, sliding_window):
    """``flashattn.decode`` on the cached keys where they lie, ``(B, H, N_q, D)``, for a ``mask``
    the mask function answered with ``span`` (``Spans``: each sequence's first valid key and valid
    entries, the pattern); None where decode cannot compute the call (gradients, dropout, a query
    as long as its keys, a layer whose causality or window differs from its mask's pattern): the
    general path then runs with the mask. Nothing is read on the host."""
    batch, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    cache_leftpad, cache_seqlens, (_, window, _) = span
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    call = Call(causal=True, window=window_of(window, True), **options)
    if not causal or window_of(sliding_window, True) != call.window or n_k <= n_q or mask.shape[-1] != n_k \
            or mask.shape[0] != batch or not call.may_decode(query, key, value, n_q, reads=False):
        return None
    return call.finish(flashattn.decode(query, key, value, cache_seqlens, scale=call.scale, softcap=call.softcap or 0.0,
                                        window_size=call.window, cache_leftpad=cache_leftpad, max_seqlen=n_k,
                                        return_lse=call.sinks is not None))


def window_of(sliding_window, causal):
    """FlashAttention's ``window_size`` for a layer's ``sliding_window`` (None: no window)."""
    if sliding_window is None:
        return -1, -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    # Causal: key j is seen from query i when i - sliding_window < j <= i (the query counts). Not
    # causal: |i - j| < sliding_window, as transformers' FlashAttention path maps it (a model's
    # bidirectional mask agrees: ModernBERT passes its half window + 1 and masks |i - j| <= half).
    return (sliding_window - 1, 0) if causal else (sliding_window - 1, sliding_window - 1)


class Call:
    """One layer's call: the options every sequence shares, and the ways to run it."""

    def __init__(self, scale, causal, window, dropout, softcap, gqa, tracing=False, sinks=None):
        self.scale, self.causal, self.window = scale, causal, window
        self.dropout, self.softcap, self.gqa, self.tracing, self.sinks = dropout, softcap, gqa, tracing, sinks

    def finish(self, result, packed=False):
        """A flashattn call's result as the layer returns it: the output, with attention sinks
        (``s_aux``, GPT-OSS's) rescaled from ``(out, lse)``. Each head's sink logit joins every
        row's softmax and is dropped after it, so the row's sum of exponentials grows from
        ``e^lse`` to ``e^lse + e^sink`` and its output scales by ``sigmoid(lse - sink)`` (0 where
        no key is seen): exact, and the gradients reach the sinks, and the kernels through lse.
        ``out`` ``(..., H, N, D)`` with lse ``(..., H, N)``, or ``packed``: ``(T, H, D)`` with lse
        ``(H, T)`` (varlen_attention's layouts)."""
        if self.sinks is None:
            return result
        out, lse = result
        sinks = self.sinks.float()
        weight = torch.sigmoid(lse.transpose(0, 1) - sinks) if packed else torch.sigmoid(lse - sinks[:, None])
        return (out * weight[..., None]).to(out.dtype)

    def may_decode(self, query, key, value, n_q, reads=True):
        """Whether ``flashattn.decode`` can compute this call: causal, forward only, no dropout
        (softcap and windows it takes, aligned bottom-right), values of the queries' head dim
        (decode's kernels hold one), and not while tracing (decode reads its lengths on the host;
        with ``reads=False``, a call with ``max_seqlen`` that reads nothing, it may be captured in
        a CUDA graph, but torch.compile does not trace it)."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        traced = self.tracing if reads else torch.compiler.is_compiling()
        return (self.causal and not grad and not self.dropout and value.shape[-1] == query.shape[-1]
                and not traced)

    def options(self, cached):
        """The keywords of a flashattn call beyond the defaults; ``cached``: some sequence has more
        keys than queries (a KV cache's queries are the newest tokens)."""
        options = dict(is_causal=self.causal, scale=self.scale, enable_gqa=self.gqa, window_size=self.window)
        if self.causal and cached:
            # Only then: with as many queries as keys both alignments agree, and a call without
            # the option stays one that the Gluon kernels can take (flashattn.ops.dispatch).
            options["causal_alignment"] = "bottom_right"
        if self.dropout:
            options["dropout_p"] = self.dropout
        if self.softcap is not None:
            options["softcap"] = float(self.softcap)
        if self.sinks is not None:
            options["return_lse"] = True   # for finish
        return options

    def dense(self, query, key, value):
        """Every sequence of the batch is whole: ``(B, H, N, D)`` in and out."""
        n_q, n_k = query.shape[2], key.shape[2]
        if n_k > n_q and self.may_decode(query, key, value, n_q):
            # The lengths on the host, where decode checks them without waiting for the GPU.
            lengths = torch.full((query.shape[0],), n_k, dtype=torch.int32)
            return self.finish(flashattn.decode(query, key, value, lengths, scale=self.scale,
                                                softcap=self.softcap or 0.0, window_size=self.window,
                                                return_lse=self.sinks is not None))
        return self.finish(flashattn.attention(query, key, value, **self.options(cached=n_k > n_q)))

    def masked(self, query, key, value, attn_mask):
        """``(B, H, N, D)`` in and out, with ``attn_mask`` (bool or additive, broadcast to
        ``(B, H, N_q, N_k)``) beside the call's causal mask and window."""
        n_q, n_k = query.shape[2], key.shape[2]
        return self.finish(flashattn.attention(query, key, value, attn_mask.to(query.device),
                                               **self.options(cached=n_k > n_q)))

    def packed(self, q, k, v, lengths_q, lengths_k):
        """Packed sequences, ``(tokens, H, D)``, of the given lengths (lists of ints)."""
        if self.causal and any(nq > nk for nq, nk in zip(lengths_q, lengths_k)):
            raise ValueError("a causal sequence has more queries than keys: its own keys must be among them")
        if not any(lengths_q):
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        if any(nk > nq for nq, nk in zip(lengths_q, lengths_k)) and \
                all(nq == lengths_q[0] for nq in lengths_q) and self.may_decode(q, k, v, lengths_q[0]):
            return self.decode_packed(q, k, v, lengths_q[0], lengths_k)
        return self.finish(flashattn.varlen_attention(
            q, k, v, cumulative(lengths_q, q.device), cumulative(lengths_k, q.device),
            max(lengths_q), max(lengths_k), **self.options(cached=lengths_k != lengths_q)), packed=True)

    def decode_packed(self, q, k, v, n_q, lengths_k):
        """``flashattn.decode`` for packed sequences of ``n_q`` queries each: their keys are laid
        out as a cache, each sequence's from its first entry, as decode reads them."""
        batch, longest = len(lengths_k), max(lengths_k)
        first = torch.tensor([0, *lengths_k[:-1]], device=k.device).cumsum(0)
        index = (first[:, None] + torch.arange(longest, device=k.device)).clamp(max=k.shape[0] - 1)
        k_cache, v_cache = (t[index].transpose(1, 2) for t in (k, v))   # (B, H_kv, longest, D)
        query = q.view(batch, n_q, q.shape[1], q.shape[2]).transpose(1, 2)
        out = self.finish(flashattn.decode(query, k_cache, v_cache, torch.tensor(lengths_k, dtype=torch.int32),
                                           scale=self.scale, softcap=self.softcap or 0.0, window_size=self.window,
                                           return_lse=self.sinks is not None))
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])


def padded(call, q, k, v, attention_mask):
    """A padded batch, ``(B, N, H, D)``, its mask ``(B, N_k)``: its tokens packed, attended, and
    scattered back (padding rows get 0). Reads the lengths on the host (not while tracing)."""
    batch, n_q, heads_q, _ = q.shape
    mask = attention_mask.to(device=q.device, dtype=torch.bool)
    # Causal self-attention: the queries are the newest tokens, the mask's last columns. Without
    # causality every query row is computed (as SDPA does for padding rows).
    rows = mask[:, -n_q:] if call.causal else mask.new_ones(batch, n_q)
    q_index, k_index = rows.reshape(-1).nonzero().flatten(), mask.reshape(-1).nonzero().flatten()
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]  # v keeps its own head dim
    out = call.packed(flat[0][q_index], flat[1][k_index], flat[2][k_index],
                      rows.sum(1).tolist(), mask.sum(1).tolist())
    full = out.new_zeros(batch * n_q, heads_q, v.shape[3]).index_copy(0, q_index, out)
    return full.view(batch, n_q, heads_q, v.shape[3])
