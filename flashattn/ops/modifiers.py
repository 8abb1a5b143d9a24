"""The checks of what ``flashattn.attention`` adds to plain attention (``attn_mask``, ``dropout_p``,
``causal_alignment``, ``softcap``, ``alibi_slopes``) and their translation into the kernels'
:class:`flashattn.kernels.mods.ScoreMods`.

Every mistake is reported as a TypeError or ValueError that names the argument. A mask and the
slopes are brought to the kernels' (batch, heads, ...) layout by views only (a dim of size 1 stays
of size 1 and is read with stride 0), so that a key-padding mask is never expanded in memory.
"""
import math
import numbers
import sys

import torch

from ..kernels.mods import ScoreMods

ALIGNMENTS = ("top_left", "bottom_right")
#: torch.nn.attention.bias's causal variants (by name), as flashattn's alignment
_VARIANTS = {"UPPER_LEFT": "top_left", "LOWER_RIGHT": "bottom_right"}


def _causal_bias_class():
    """``torch.nn.attention.bias.CausalBias`` where that module was imported, else None: importing
    it imports torch._dynamo (a second or more), which a first attention call must not pay; a
    caller holding a causal bias has imported it already."""
    module = sys.modules.get("torch.nn.attention.bias")
    return None if module is None else module.CausalBias


def type_name(x):
    """``bool``, ``int``, ``numpy.float64``: the type's name, with its module where not built in."""
    kind = type(x)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def causal_bias(attn_mask, is_causal, causal_alignment, q, k):
    """``(attn_mask, is_causal, causal_alignment)`` with a ``torch.nn.attention.bias`` causal bias
    (``causal_upper_left``, ``causal_lower_right``) turned into ``is_causal`` and its alignment, as
    SDPA reads it (with ``is_causal=True`` too it is refused: it says the causal mask itself). A
    tensor mask passes unchanged: with ``is_causal=True`` both apply."""
    check_alignment(causal_alignment)
    bias_class = _causal_bias_class()
    if bias_class is not None and isinstance(attn_mask, bias_class):
        if is_causal:
            raise ValueError("attn_mask is a causal bias (torch.nn.attention.bias) and is_causal=True: "
                             "pass one of them")
        if causal_alignment != "top_left":
            raise ValueError("attn_mask is a causal bias (torch.nn.attention.bias), which sets the alignment "
                             f"itself; causal_alignment={causal_alignment!r} must be left at 'top_left'")
        for name, t, n in (("q", q, attn_mask.seq_len_q), ("k", k, attn_mask.seq_len_kv)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != n:
                raise ValueError(f"attn_mask is a causal bias for {attn_mask.seq_len_q} queries and "
                                 f"{attn_mask.seq_len_kv} keys, but {name} has sequence length {t.shape[-2]}")
        return None, True, _VARIANTS[attn_mask.variant.name]
    return attn_mask, is_causal, causal_alignment


def check_alignment(causal_alignment):
    if not isinstance(causal_alignment, str):
        raise TypeError(f"causal_alignment must be a str, 'top_left' or 'bottom_right', got "
                        f"{type_name(causal_alignment)}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")


def check_dropout(dropout_p):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type_name(dropout_p)}")
    if not 0.0 <= dropout_p < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_softcap(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number >= 0 (0: no cap), got {type_name(softcap)}")
    if not 0.0 <= softcap < math.inf:  # NaN fails too (and torch.compile traces this, not isfinite)
        raise ValueError(f"softcap must be a finite number >= 0 (0: no cap), got {softcap}")
    return float(softcap)


def check_alibi(alibi_slopes, q, rows, heads, rows_name="q's leading dims"):
    """``alibi_slopes`` as a 2-D view ``(1 or rows, heads)``; accepted shapes ``(heads,)`` and
    ``(rows, heads)`` (or q's leading dims)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor (float32) or None, got {type_name(alibi_slopes)}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; expected torch.float32")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but no gradient is computed for it; pass "
                         "alibi_slopes.detach()")
    shape = tuple(alibi_slopes.shape)
    if shape == (heads,):
        return alibi_slopes.reshape(1, heads)
    if alibi_slopes.dim() >= 2 and shape[-1] == heads and math.prod(shape[:-1]) == rows:
        return alibi_slopes.reshape(rows, heads)
    raise ValueError(f"alibi_slopes has shape {shape}; expected ({heads},) or ({rows}, {heads}) "
                     f"(one row per entry of {rows_name}), one slope per query head")


def check_mask(attn_mask, q, k):
    """``attn_mask`` (bool or float, broadcastable to ``q.shape[:-1] + (N_kv,)``) as a 4-D view
    ``(1 or B, 1 or H, 1 or N_q, 1 or N_kv)`` for the kernels' (B, H) layout of q."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError("attn_mask must be None, a torch.Tensor (bool or float) or a "
                        f"torch.nn.attention.bias causal bias, got {type_name(attn_mask)} (note: the 4th "
                        "positional argument is attn_mask, as in scaled_dot_product_attention)")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; expected torch.bool (True: the pair "
                        "takes part) or a float dtype (added to the scores)")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("attn_mask requires grad, but flashattn.attention computes no gradient for "
                         "the mask; pass attn_mask.detach() (or use scaled_dot_product_attention's math "
                         "backend for a learned bias)")
    target = tuple(q.shape[:-1]) + (k.shape[-2],)
    shape = tuple(attn_mask.shape)
    if (len(shape) > len(target) or len(shape) == 0
            or any(m not in (1, t) for m, t in zip(shape[::-1], target[::-1]))):
        raise ValueError(f"attn_mask has shape {shape}, which does not broadcast to {target} "
                         "(q's leading dims, N_q, N_kv)")
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape)
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    elif all(n == 1 for n in mask.shape[:-3]):
        mask = mask.reshape(1, *mask.shape[-3:])
    else:
        # Leading dims beyond (heads, N_q, N_kv) merge into the kernels' batch: where they
        # broadcast only in part, those dims (and only those) are expanded.
        rest = tuple(mask.shape[-3:])
        mask = mask.expand(*target[:-3], *rest).reshape(math.prod(target[:-3]), *rest)
    # A dim the caller expanded (stride 0) is one row repeated: read as a broadcast dim of size 1,
    # so that a key-padding mask expanded to (B, H, N_q, N_kv) is still read as a row of keys.
    for d in range(4):
        if mask.stride(d) == 0 and mask.shape[d] > 1:
            mask = mask.narrow(d, 0, 1)
    return mask


def draw_seed():
    """A dropout seed from torch's default generator, as a 0-dim int64 tensor below 2**31 (so that
    the kernels' seed argument keeps one type and compiles once): after ``torch.manual_seed(s)``
    the first call draws the same seed every time."""
    return torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64)


def score_mods(q, k, attn_mask, dropout_p, is_causal, causal_alignment, softcap, alibi_slopes,
               batch, heads):
    """The kernels' :class:`ScoreMods` for one call (None when nothing is added), every argument
    checked. The dropout seed is drawn here, from torch's default generator (a 0-dim tensor, so
    that torch.compile keeps it in the graph)."""
    dropout_p = check_dropout(dropout_p)
    softcap = check_softcap(softcap)
    slopes = check_alibi(alibi_slopes, q, batch, heads)
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    seed = draw_seed() if dropout_p > 0 else None
    mods = ScoreMods(softcap, slopes, mask, dropout_p, seed, causal_alignment == "bottom_right")
    return mods if mods.active else None
