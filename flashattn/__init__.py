"""flashattn: FlashAttention forward and backward kernels in Triton, and the course built on them.

    import torch, flashattn
    out = flashattn.attention(q, k, v, is_causal=True)            # autograd flows through it
    out, lse = flashattn.attention(q, k, v, is_causal=True, return_lse=True)
    out = flashattn.attention(q, k, v, enable_gqa=True, window_size=(256, 0))  # grouped, windowed
    out = flashattn.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # packed

Importing the package picks the runtime (``flashattn.RUNTIME``): compiled kernels on a CUDA GPU,
or the very same kernels through Triton's interpreter on CPU tensors when there is none. Inputs
must live on ``flashattn.DEVICE``.
"""
from .gpu.runtime import DEVICE, INTERPRET, RUNTIME, describe  # first: it decides TRITON_INTERPRET

from .ops.attention import attention  # noqa: E402  (the kernels must be defined after the runtime choice)
from .ops.decode import decode  # noqa: E402
from .ops.varlen import varlen_attention  # noqa: E402

__all__ = ["attention", "varlen_attention", "decode", "DEVICE", "INTERPRET", "RUNTIME", "describe"]
#: The layers, bottom up (CONTRIBUTING.md draws them; tests/test_layers.py checks that every import
#: points down this list).
LAYERS = ("gpu", "kernels", "hopper", "ops", "distributed", "integrations", "testing", "plotting", "measure",
          "course")


def __getattr__(name):
    """``flashattn.course`` and the other layers work after a plain ``import flashattn``: a
    subpackage is imported the first time it is used (so importing the package stays light)."""
    if name in LAYERS:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashattn' has no attribute {name!r}")


__version__ = "0.1.0"
