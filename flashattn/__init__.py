"""flashattn: FlashAttention forward and backward kernels in Triton, and the course built on them.

    import torch, flashattn
    out = flashattn.attention(q, k, v, is_causal=True)            # autograd flows through it
    out, lse = flashattn.attention(q, k, v, is_causal=True, return_lse=True)

Importing the package picks the runtime (``flashattn.RUNTIME``): compiled kernels on a CUDA GPU,
or the very same kernels through Triton's interpreter on CPU tensors when there is none. Inputs
must live on ``flashattn.DEVICE``.
"""
from .runtime import DEVICE, INTERPRET, RUNTIME, describe  # first: it decides TRITON_INTERPRET

from .api import attention  # noqa: E402  (the kernels must be defined after the runtime choice)

__all__ = ["attention", "DEVICE", "INTERPRET", "RUNTIME", "describe"]
__version__ = "0.1.0"
