"""Where the kernels run: compiled on a CUDA GPU, or through Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is *defined*, by
reading the environment variable ``TRITON_INTERPRET``. So this module must run before any kernel
module is imported; ``flashattn/__init__.py`` imports it first.

The rule is simple: if PyTorch sees a CUDA GPU, the kernels are compiled for it and take CUDA
tensors. Otherwise (or if the user already set ``TRITON_INTERPRET=1``) the very same kernels run in
the interpreter, which executes each program with NumPy on CPU tensors.
"""
import functools
import os
import sys
import threading
import warnings

import torch

def _kernels_defined_outside_triton():
    """The names of the ``@triton.jit`` functions that exist now and were defined outside Triton's
    own modules. Libraries import triton without defining any kernel (torch._dynamo does, so
    importing a transformers model does): re-importing triton then loses nothing. Triton's own
    helpers (tl.standard's, tl.random's) are made again by the re-import."""
    import gc

    jit = sys.modules.get("triton.runtime.jit")
    kind = getattr(jit, "JITFunction", None)
    if kind is None:
        return []
    found = []
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance also reads obj.__class__, which some objects
        # answer with a deprecation warning (torch.distributed.reduce_op)
        if issubclass(type(obj), kind):
            module = getattr(getattr(obj, "fn", None), "__module__", None) or ""
            if module.split(".")[0] != "triton":
                found.append(f"{module}.{getattr(obj, '__name__', '?')}")
    return found


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
        # import below gets a copy in interpreter mode. That is harmless unless kernels were
        # already defined with the first copy: only then is there something to warn about.
        kernels = _kernels_defined_outside_triton()
        for name in [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]:
            del sys.modules[name]
        if kernels:
            shown = ", ".join(kernels[:3]) + (", ..." if len(kernels) > 3 else "")
            warnings.warn("triton was imported before flashattn on a machine without a CUDA GPU; "
                          "flashattn re-imported it in interpreter mode. The kernels defined with "
                          f"the triton imported earlier ({shown}) will not run on the CPU: import "
                          "flashattn first (or set TRITON_INTERPRET=1 before starting Python).",
                          stacklevel=2)


def _exact_interpreter_dots():
    """Make the interpreter's ``tl.dot`` sum in float64 and round once to the accumulator's dtype.

    The interpreter multiplies tiles with ``numpy.matmul``, whose float32 result depends on which
    BLAS kernel NumPy picks for the CPU at hand: the same float32 test passed on one x86 machine
    and failed on another (OpenBLAS's Haswell and Zen kernels gave a 5x larger dV error at large
    scores). A GPU's tensor cores accumulate in float32 in their own order, so no CPU order is "the
    GPU's"; one exact sum makes the CPU results the same everywhere. Everything else (exp2, the
    running max and sum, the casts) keeps the kernels' own precision, and the GPU tests check the
    compiled dots."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = (np.float16, np.float32)
        if a.data.dtype not in floats or b.data.dtype not in floats or d.data.dtype not in floats:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data
        return interpreter.TensorHandle(exact.astype(d.data.dtype), d.dtype.scalar)

    builder.create_dot = create_dot


if INTERPRET:
    _exact_interpreter_dots()


#: Held around every interpreter launch: Triton's interpreter swaps module-level state (the
#: ``tl`` functions it patches, the program ids) for the duration of a launch, so two threads
#: interpreting at once read each other's state and get wrong results or errors. Compiled launches
#: need no lock.
INTERPRETER_LOCK = threading.RLock()

#: "gpu" when the kernels are compiled, "interpreter" when they run on the CPU.
RUNTIME = "interpreter" if INTERPRET else "gpu"
#: The device the inputs of :func:`flashattn.attention` must live on.
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")


def bf16_in_float32(interpret: bool, capability=None) -> bool:
    """Whether bfloat16 inputs are computed in float32 (upcast before the kernels, rounded back
    after): on the interpreter, which multiplies tiles with NumPy, which has no bfloat16 (its bf16
    tl.dot returns garbage); and on GPUs before sm_80 (T4, RTX 20: ``capability`` (7, 5)), which
    have no bfloat16 arithmetic and where Triton has no tensor-core path for any dtype."""
    return interpret or tuple(capability) < (8, 0)


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


#: The dtypes the kernels read.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_dtype(*tensors):
    """The tensors as the kernels should read them here: unchanged, except bfloat16 upcast to
    float32 where :func:`bf16_in_float32` says so. Upcasting changes no value; the results are
    rounded back to bfloat16 by the caller. Any other dtype is refused: the launchers below the
    public ops would otherwise run float64 through float32 pointers and return garbage."""
    for t in tensors:
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the kernels take float16, bfloat16 or float32 tensors, got {t.dtype} "
                            f"(shape {tuple(t.shape)}): convert it first, e.g. .float()")
    first = next((t for t in tensors if t is not None), None)
    if first is not None and bf16_in_float32(INTERPRET, None if INTERPRET else _capability(first.device.index)):
        return [t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors]
    return list(tensors)


def cache_dir():
    """Where flashattn keeps files between processes (autotuning's choices, downloaded course data):
    ``$FLASHATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashattn`` (``~/.cache/flashattn``)."""
    import pathlib

    if os.environ.get("FLASHATTN_CACHE_DIR"):
        return pathlib.Path(os.environ["FLASHATTN_CACHE_DIR"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "flashattn"


def describe() -> str:
    """One line saying where the kernels run and why, for the first cell of every notebook."""
    import triton

    where = "Triton interpreter on the CPU" if INTERPRET else "compiled Triton kernels on the GPU"
    return (f"flashattn runs {where} ({REASON}); "
            f"torch {torch.__version__}, triton {triton.__version__}")
