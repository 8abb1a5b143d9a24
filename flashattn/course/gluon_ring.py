"""Chapter 12's own Gluon kernel, as small as a ring of buffers can be: the sum of the ``n_tiles``
tiles of a ``(n_tiles * BLOCK, D)`` fp16 tensor, streamed through a ring of ``STAGES`` shared-memory
buffers. A producer warp copies tile ``j`` with TMA into slot ``j % STAGES``; the consumer warpgroup
waits for it on ``ready[slot]``, adds it to its sum in registers and releases the slot on
``empty[slot]``. The producer is the learner's (chapter 12, exercise 2): ``ring_sum`` takes it as a
compile-time argument, so that the same kernel runs the learner's loop and the chapter's.

Gluon has no interpreter: :func:`compile_ring_sum` compiles the kernel for sm_90 on any machine
(``ptx_facts`` reads the result) and :func:`run_ring_sum` runs it on an H100/H200. Import this module
only where Triton has Gluon (Triton 3.6 and later).
"""
import importlib.util
import re
import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# TMA's copy into shared memory, under the name of the Triton at hand: Triton 3.9 calls it
# tma.async_load; 3.6 to 3.8 call it tma.async_copy_global_to_shared.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

#: What a learner's producer may use, as the chapter's cell imports it: the module its source is
#: compiled from in a child process starts with these lines.
HEADER = """from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""
#: The tile the kernel is compiled and run with: BLOCK rows of D fp16 values (8 KB), 4 consumer warps.
BLOCK, D = 64, 64


@gluon.jit
def ring_consumer(x_smem, ready, empty, out_ptr, n_tiles, BLOCK: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr):
    """The default partition (4 warps): tile by tile, wait until it has landed, add it to the sum,
    release its slot; then store the sum."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([BLOCK, D], gl.float32, layout)
    for j in range(n_tiles):
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        acc += x_smem.index(slot).load(layout).to(gl.float32)
        mbarrier.arrive(empty.index(slot))
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + gl.expand_dims(rows, 1) * D + gl.expand_dims(cols, 0), acc)


@gluon.jit
def producer_partition(PRODUCER: gl.constexpr, desc, x_smem, ready, empty, n_tiles, BLOCK: gl.constexpr,
                       STAGES: gl.constexpr):
    """The worker partition (1 warp): the producer given at compile time."""
    PRODUCER(desc, x_smem, ready, empty, n_tiles, BLOCK, STAGES)


@gluon.jit
def ring_sum(desc, out_ptr, n_tiles, PRODUCER: gl.constexpr, BLOCK: gl.constexpr, D: gl.constexpr,
             STAGES: gl.constexpr):
    """One program: the ring's buffers and barriers, then the consumer and the producer side by side."""
    x_smem = gl.allocate_shared_memory(desc.dtype, [STAGES, BLOCK, D], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)   # one arrival: the producer's expect
        mbarrier.init(empty.index(i), count=1)   # one arrival: the consumer's release
    gl.warp_specialize([
        (ring_consumer, (x_smem, ready, empty, out_ptr, n_tiles, BLOCK, D, STAGES)),
        (producer_partition, (PRODUCER, desc, x_smem, ready, empty, n_tiles, BLOCK, STAGES)),
    ], [1], [24])


def _layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK, D], gl.float16)


def compile_ring_sum(producer, stages=3):
    """``ring_sum`` with ``producer`` (a @gluon.jit function) compiled for sm_90, on any machine."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict(desc=f"tensordesc<fp16[{BLOCK}, {D}],{_layout()!r}>", out_ptr="*fp32", n_tiles="i32",
                     PRODUCER="constexpr", BLOCK="constexpr", D="constexpr", STAGES="constexpr")
    constexprs = dict(PRODUCER=producer, BLOCK=BLOCK, D=D, STAGES=stages)
    source = GluonASTSource(ring_sum, signature, constexprs, {(1,): [["tt.divisibility", 16]]})
    with warnings.catch_warnings():  # Triton 3.9 warns once about a default that does not concern this kernel
        warnings.simplefilter("ignore", UserWarning)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def ptx_facts(kernel):
    """What the compiled ``ring_sum`` holds, counted in its PTX: TMA copies into shared memory, the
    expects (``mbarrier.arrive.expect_tx``), the other arrives, and the waits (``try_wait``)."""
    ptx = kernel.asm["ptx"]
    expects = len(re.findall(r"\bmbarrier\.arrive\.expect_tx", ptx))
    return dict(tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)),
                expects=expects, arrives=len(re.findall(r"\bmbarrier\.arrive\b", ptx)) - expects,
                waits=len(re.findall(r"\bmbarrier\.try_wait", ptx)))


def run_ring_sum(producer, n_tiles, stages, seed=0):
    """Run ``ring_sum`` with ``producer`` on this CUDA GPU (compute capability 9): the largest
    difference between its sum of ``n_tiles`` random fp16 tiles and PyTorch's."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n_tiles * BLOCK, D, device="cuda", dtype=torch.float16, generator=g)
    out = torch.full((BLOCK, D), float("nan"), device="cuda")
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [BLOCK, D], _layout())
    ring_sum[(1,)](desc, out, n_tiles, PRODUCER=producer, BLOCK=BLOCK, D=D, STAGES=stages, num_warps=4)
    torch.cuda.synchronize()
    want = x.float().view(n_tiles, BLOCK, D).sum(0)
    return float((out - want).abs().max())


def compile_error_text(error):
    """One line for a compile error: the line it points at (the innermost: the learner's) and its cause."""
    chain = []
    while error is not None and len(chain) < 12:
        chain.append(error)
        error = error.__cause__ or error.__context__
    pointed = [e for e in chain if type(e).__name__ == "CompilationError"]
    where = ""
    if pointed:
        lines = str(pointed[-1]).splitlines()
        marks = [i for i, line in enumerate(lines) if line.strip() == "^"]
        if marks and marks[0] > 0:
            where = f"at `{lines[marks[0] - 1].strip()}`: "
    cause = chain[-1]
    text = [line for line in str(cause).splitlines() if line.strip()]
    return f"{where}{type(cause).__name__}: {text[-1][:300] if text else ''}"


def _producer_from(path, name):
    spec = importlib.util.spec_from_file_location("ring_producer_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def compile_source(path, name):
    """In a child process (``flashattn.measure.compiled.in_child``; Triton's interpreter, once it has
    run in a process, leaves Gluon's compiler unusable there): ``ring_sum`` compiled for sm_90 with
    the producer ``name`` of the file ``path`` (``HEADER`` and the learner's source). Its
    :func:`ptx_facts`, or ``{"error": one line}``."""
    producer = _producer_from(path, name)
    try:
        return ptx_facts(compile_ring_sum(producer))
    except Exception as error:
        return dict(error=compile_error_text(error))


def run_source(path, name, cases):
    """In a child process: the producer ``name`` from the file ``path``, run for each
    ``(n_tiles, stages)`` of ``cases``. A producer that deadlocks never returns: the parent's
    timeout says so."""
    producer = _producer_from(path, name)
    return [run_ring_sum(producer, n_tiles, stages, seed=i) for i, (n_tiles, stages) in enumerate(cases)]
