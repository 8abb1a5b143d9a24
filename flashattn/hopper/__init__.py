"""The Gluon kernels for H100/H200 (sm_90): the forward (``forward``) and the backward
(``backward``), FlashAttention-3's structure written by hand (chapter 12), and the elementwise math
of their score tiles (``scores``).

They compute what the Triton kernels of ``flashattn.kernels`` compute, in the same layout, so the
two mix freely (``flashattn.ops.dispatch`` picks per call). Gluon has no interpreter, so nothing
here is imported until :func:`load` asks for it on a GPU; on a CPU the modules are only read and
compiled for sm_90 (``flashattn.measure.compiled``).
"""
import importlib
import os
import threading

import torch

from ..gpu.runtime import INTERPRET

_importing = threading.Lock()


def load(name):
    """``flashattn.hopper.<name>`` (``"forward"`` or ``"backward"``) where its kernels may run;
    else None: on the interpreter (Gluon kernels cannot be defined for it), with
    FLASHATTN_GLUON=0, or with a Triton that has no Gluon or another Gluon API. Imported on first
    use."""
    if INTERPRET or os.environ.get("FLASHATTN_GLUON", "1") == "0":
        return None
    try:
        # One thread at a time: Triton's Gluon modules import one another, and two threads
        # importing them at once (the warm-up's beside the forward's) can stop on Python's import
        # deadlock error.
        with _importing:
            return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None


#: Whether the fused backward takes key-padding masks (:func:`backward_key_mask`) in
#: ``flashattn.ops.dispatch``. On: checked against float64 on an H100 (``flashattn.measure.gpu_checks
#: gluon_mods``, the cases named ``key-``) and faster than FlexAttention's block mask there
#: (docs/performance.md, "Key-padding masks on the fused backward"); False sends masked calls'
#: backward to the Triton kernels and their tile lists.
FUSED_KEY_MASKS = True


def backward_key_mask(mask):
    """The kernels' 4-D ``attn_mask`` (``flashattn.ops.modifiers.check_mask``: a dim that broadcasts
    has size 1) where the fused Gluon backward reads it, as its KEY_MASK: a key-padding mask, bool,
    the same row of keys for every head and query, shape (B or 1, 1, 1, N_kv). None for any other
    mask (and for None)."""
    if mask is None or mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    return mask
