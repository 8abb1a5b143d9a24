"""Hugging Face transformers models on flashattn's kernels.

    import flashattn.integrations.transformers as fa_transformers
    name = fa_transformers.register()                   # "fa_triton"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

transformers looks up each layer's attention function by the name in ``attn_implementation``, in
its ``AttentionInterface``, and calls it with the query, key and value states ``(B, H, N, D)``
after the rotary embedding and the KV cache's update. The mask reaching that function is made by
the mask function registered under the same name in ``AttentionMaskInterface``: here it is the 2-D
padding mask (True for a token, False for padding) or None, never a 4-D mask of N_q x N_k, since
the kernels mask causality and windows themselves. (A name missing from the mask interface gets
no mask at all, and a padded batch would silently attend its padding.)

What the attention function does with what it gets:

- no mask, query as long as the keys: ``flashattn.attention``, causal, windowed, grouped heads as
  they come;
- ``position_ids`` that restart (several sequences packed in a row, as transformers' data collator
  for padding-free training makes them), or FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k``
  keywords: ``flashattn.varlen_attention`` over the sequences;
- a padding mask: the tokens are gathered into a packed batch (no padding), attended with
  ``varlen_attention`` and scattered back; padding rows of the output are 0;
- a query shorter than its keys (a KV cache: generation, or a prompt fed in chunks): causal masking
  and sliding windows are aligned bottom-right, the last query seeing the last key
  (``causal_alignment="bottom_right"``; SDPA's ``is_causal`` and flashattn's default align them
  top-left). In a packed batch the alignment holds within each sequence, so a padded batch with a
  cache is one ``varlen_attention`` call. Without gradients or dropout, ``flashattn.decode``, made
  for this case, runs instead.

transformers' sliding windows count the query itself: ``sliding_window=w`` lets query ``i`` see
keys ``i - w < j <= i``, which is FlashAttention's ``window_size=(w - 1, 0)``.
"""
import numbers

import torch

import flashattn

try:
    from transformers import AttentionInterface, AttentionMaskInterface
except ImportError as error:  # the integration is optional: say how to get what it needs
    raise ImportError("flashattn.integrations.transformers needs Hugging Face transformers: "
                      'pip install "flashattn[transformers]"') from error

#: The name registered by default. transformers reads any name containing "flash" as one of its
#: FlashAttention backends (and a name with a "/" as a kernel on the Hub), so it must avoid both.
DEFAULT_NAME = "fa_triton"


def register(name=None):
    """Register flashattn's attention (and its padding-mask function) with transformers under
    ``name`` (by default ``DEFAULT_NAME``) and return the name to pass as ``attn_implementation``."""
    name = DEFAULT_NAME if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower() or "/" in name or name in ("eager", "sdpa", "flex_attention"):
        raise ValueError(f"name {name!r} is taken by transformers: a name containing 'flash' selects its "
                         "FlashAttention backends, one with '/' a kernel from the Hub, and eager, sdpa, "
                         "flex_attention are its own; choose another")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """transformers' mask function for this attention: the 2-D padding mask of the keys the layer
    holds (bool, ``(B, N_k)``), or None when nothing is padded.

    The causal and window patterns (``mask_function``) are left to the kernels; the mask function's
    other overlays (bidirectional image tokens, chunked attention) are not supported.
    """
    if attention_mask is None:
        return None
    # A sliding-window cache holds only the last keys: their columns are the mask's last ones.
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[-1] == kv_length and bool(mask.all()):
        return None
    return mask


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention function: ``(B, H_q, N_q, D)`` queries against ``(B, H_kv, N_k, D)``
    keys and values; returns ``(out, None)`` with ``out`` of shape ``(B, N_q, H_q, D)`` (no
    attention weights: they are never formed)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flashattn's transformers integration does not support attention sinks "
                                  "(s_aux); use attn_implementation='eager'")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("flashattn never forms the attention weights (output_attentions=True); "
                                  "use attn_implementation='eager'")
    batch, heads_q, n_q, _ = query.shape
    heads_kv, n_k = key.shape[1], key.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"the query has {heads_q} heads and the keys {heads_kv}: the query heads must be "
                         "a multiple of the key heads")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if causal and n_q > n_k:
        raise ValueError(f"a causal layer got {n_q} queries but only {n_k} keys: a query's own key "
                         "must be among the keys")
    call = Call(scale=scaling, causal=causal, window=window_of(sliding_window, causal),
                dropout=float(dropout or 0.0), softcap=softcap, gqa=heads_q != heads_kv)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, N, H, D): the tokens' layout

    if attention_mask is not None:
        out = padded(call, q, k, v, attention_mask)
    else:
        lengths = packed_lengths(kwargs, batch, n_q, n_k)
        if lengths is not None:
            out = call.packed(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), *lengths)  # v: its head dim
            out = out.view(batch, n_q, heads_q, value.shape[-1])
        else:
            out = call.dense(query, key, value).transpose(1, 2)
    return out.contiguous(), None


def window_of(sliding_window, causal):
    """FlashAttention's ``window_size`` for transformers' ``sliding_window`` (None: no window)."""
    if sliding_window is None:
        return -1, -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    # Causal: key j is seen from query i when i - sliding_window < j <= i (the query counts). Not
    # causal: masking_utils' bidirectional window keeps |i - j| <= sliding_window.
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


class Call:
    """One layer's call: the options every sequence shares, and the three ways to run it."""

    def __init__(self, scale, causal, window, dropout, softcap, gqa):
        self.scale, self.causal, self.window = scale, causal, window
        self.dropout, self.softcap, self.gqa = dropout, softcap, gqa

    def may_decode(self, query, key, value, n_q):
        """Whether ``flashattn.decode`` can compute this call: causal, forward only, no dropout
        (softcap and windows it takes, aligned bottom-right), and values of the queries' head dim
        (decode's kernels hold one)."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return self.causal and not grad and not self.dropout and value.shape[-1] == query.shape[-1]

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
        return options

    def dense(self, query, key, value):
        """Every sequence of the batch is whole: ``(B, H, N, D)`` in and out."""
        n_q, n_k = query.shape[2], key.shape[2]
        if n_k > n_q and self.may_decode(query, key, value, n_q):
            # The lengths on the host, where decode checks them without waiting for the GPU.
            lengths = torch.full((query.shape[0],), n_k, dtype=torch.int32)
            return flashattn.decode(query, key, value, lengths, scale=self.scale, softcap=self.softcap or 0.0,
                                    window_size=self.window)
        return flashattn.attention(query, key, value, **self.options(cached=n_k > n_q))

    def packed(self, q, k, v, lengths_q, lengths_k):
        """Packed sequences, ``(tokens, H, D)``, of the given lengths (lists of ints)."""
        if self.causal and any(nq > nk for nq, nk in zip(lengths_q, lengths_k)):
            raise ValueError("a causal sequence has more queries than keys: its own keys must be among them")
        if not any(lengths_q):
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        if any(nk > nq for nq, nk in zip(lengths_q, lengths_k)) and \
                all(nq == lengths_q[0] for nq in lengths_q) and self.may_decode(q, k, v, lengths_q[0]):
            return self.decode_packed(q, k, v, lengths_q[0], lengths_k)
        return flashattn.varlen_attention(
            q, k, v, cumulative(lengths_q, q.device), cumulative(lengths_k, q.device),
            max(lengths_q), max(lengths_k), **self.options(cached=lengths_k != lengths_q))

    def decode_packed(self, q, k, v, n_q, lengths_k):
        """``flashattn.decode`` for packed sequences of ``n_q`` queries each: their keys are laid
        out as a cache, each sequence's from its first entry, as decode reads them."""
        batch, longest = len(lengths_k), max(lengths_k)
        first = torch.tensor([0, *lengths_k[:-1]], device=k.device).cumsum(0)
        index = (first[:, None] + torch.arange(longest, device=k.device)).clamp(max=k.shape[0] - 1)
        k_cache, v_cache = (t[index].transpose(1, 2) for t in (k, v))   # (B, H_kv, longest, D)
        query = q.view(batch, n_q, q.shape[1], q.shape[2]).transpose(1, 2)
        out = flashattn.decode(query, k_cache, v_cache, torch.tensor(lengths_k, dtype=torch.int32),
                               scale=self.scale, softcap=self.softcap or 0.0, window_size=self.window)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])


def padded(call, q, k, v, attention_mask):
    """A padded batch, ``(B, N, H, D)``: its tokens packed, attended, and scattered back (padding
    rows get 0)."""
    if attention_mask.dim() != 2:
        raise ValueError("flashattn's attention takes the 2-D padding mask its mask function makes; got "
                         f"a mask of shape {tuple(attention_mask.shape)} (a custom 4-D mask: use 'sdpa' "
                         "or 'eager')")
    batch, n_q, heads_q, _ = q.shape
    n_k = k.shape[1]
    mask = attention_mask.to(device=q.device, dtype=torch.bool)
    if mask.shape[1] > n_k:
        raise ValueError(f"the padding mask has {mask.shape[1]} columns but the layer holds {n_k} keys")
    if mask.shape[1] < n_k:  # a static cache: its entries past the mask are not written yet
        mask = torch.cat([mask, mask.new_zeros(batch, n_k - mask.shape[1])], dim=1)
        end = attention_mask.shape[1]
    else:
        end = n_k
    # Causal self-attention: the queries are the newest tokens, the mask's last columns. Without
    # causality every query row is computed (as SDPA does for padding rows).
    rows = mask[:, end - n_q:end] if call.causal else mask.new_ones(batch, n_q)
    q_index, k_index = rows.reshape(-1).nonzero().flatten(), mask.reshape(-1).nonzero().flatten()
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]  # v keeps its own head dim
    out = call.packed(flat[0][q_index], flat[1][k_index], flat[2][k_index],
                      rows.sum(1).tolist(), mask.sum(1).tolist())
    full = out.new_zeros(batch * n_q, heads_q, v.shape[3]).index_copy(0, q_index, out)
    return full.view(batch, n_q, heads_q, v.shape[3])


def packed_lengths(kwargs, batch, n_q, n_k):
    """``(lengths_q, lengths_k)`` of the sequences packed in the batch's rows, from
    FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k`` or from ``position_ids`` restarting; None
    when each row is one sequence."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        cu_k = cu_q if cu_k is None else cu_k
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        return ([b - a for a, b in zip(bounds_q, bounds_q[1:])],
                [b - a for a, b in zip(bounds_k, bounds_k[1:])])
    position_ids = kwargs.get("position_ids")
    if position_ids is None or n_q != n_k or n_q < 2:
        return None
    positions = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
    if positions.shape[1] != n_q:
        return None
    # A sequence starts where the position does not follow the previous one (as transformers
    # finds packed sequences), and at each row.
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    if not bool(starts[:, 1:].any()):
        return None
    bounds = starts.reshape(-1).nonzero().flatten().tolist() + [batch * n_q]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return lengths, lengths


def cumulative(lengths, device):
    """``cu_seqlens`` (int32) of sequences of the given lengths."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
