"""Where the kernels run: compiled on a CUDA GPU, or through Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is *defined*, by
reading the environment variable ``TRITON_INTERPRET``. So this module must run before any kernel
module is imported; ``flashattn/__init__.py`` imports it first.

The rule is simple: if PyTorch sees a CUDA GPU, the kernels are compiled for it and take CUDA
tensors. Otherwise (or if the user already set ``TRITON_INTERPRET=1``) the very same kernels run in
the interpreter, which executes each program with NumPy on CPU tensors.
"""
import os
import sys
import warnings

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    INTERPRET = True
    REASON = "TRITON_INTERPRET=1 was set"
elif torch.cuda.is_available():
    INTERPRET = False
    REASON = f"CUDA GPU found: {torch.cuda.get_device_name()}"
else:
    INTERPRET = True
    REASON = "no CUDA GPU found"
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        # Triton was imported in compiling mode, and its own helpers (tl.max, tl.zeros, ...) were
        # built for the compiler. Forget its Python modules (not its C extension) so that the
        # import below gets a copy in interpreter mode.
        for name in [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]:
            del sys.modules[name]
        warnings.warn("triton was imported before flashattn on a machine without a CUDA GPU; "
                      "flashattn re-imported it in interpreter mode. Kernels you define with the "
                      "triton module imported earlier will not run on the CPU: import flashattn "
                      "first (or set TRITON_INTERPRET=1 before starting Python).", stacklevel=2)

#: "gpu" when the kernels are compiled, "interpreter" when they run on the CPU.
RUNTIME = "interpreter" if INTERPRET else "gpu"
#: The device the inputs of :func:`flashattn.attention` must live on.
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")


def kernel_dtype(*tensors):
    """The tensors as the kernels should read them here: unchanged on a GPU; on the interpreter,
    bfloat16 upcast to float32, because the interpreter multiplies tiles with NumPy, which has no
    bfloat16 (its bf16 tl.dot returns garbage). Upcasting changes no value; the results are
    rounded back to bfloat16 by the caller."""
    if INTERPRET:
        return [t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors]
    return list(tensors)


def describe() -> str:
    """One line saying where the kernels run and why, for the first cell of every notebook."""
    import triton

    where = "Triton interpreter on the CPU" if INTERPRET else "compiled Triton kernels on the GPU"
    return (f"flashattn runs {where} ({REASON}); "
            f"torch {torch.__version__}, triton {triton.__version__}")
