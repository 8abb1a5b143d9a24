"""The GPUs the kernels are built for: what each architecture allows, and what the running one has.

The tile rules (``flashattn.gpu.configs.fits``) judge a configuration against an :class:`Arch`: the
shared memory one block may use and how many fp32 values a thread can hold in registers before
the compiler spills. On a GPU they read the running device (``torch.cuda.get_device_properties``);
on the CPU, and in the offline compile checks, they use the table below. The shared-memory and
register figures are NVIDIA's (CUDA programming guide, compute capabilities); the register budgets
are what compiling the candidate configurations for each architecture showed
(``python tools/compile_check.py --arch all``).

How ``tl.dot`` runs decides most of it. On sm_90, 16-bit tiles go to ``wgmma``, which reads its
operands from shared memory; on sm_80-89 to ``mma.sync``, which needs them in registers, so a
thread holds fewer values before it spills; on sm_75 Triton emits no tensor-core instruction at
all (every dtype multiplies with fused multiply-adds, like IEEE float32 everywhere).
"""
import functools
from dataclasses import dataclass

import torch

from .runtime import INTERPRET


@dataclass(frozen=True)
class Arch:
    """One architecture's limits, as the tile rules use them."""
    capability: int        # 10 x major + minor: 75, 80, 86, 89, 90
    gpus: str              # examples, for messages
    smem_per_block: int    # bytes of shared memory one block may use (the opt-in maximum)
    regs_per_sm: int       # 32-bit registers per SM
    #: fp32 values per thread (accumulators and score tiles) that fit in registers without
    #: spilling, per kind of dot: "mma" (16-bit tensor cores), "tf32", "tf32x3", "fma"
    register_budget: tuple

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"

    @property
    def tensor_cores(self) -> bool:
        """Whether Triton multiplies 16-bit (and TF32) tiles on tensor cores here (sm_80 and later)."""
        return self.capability >= 80

    def budget(self, kind: str) -> float:
        # sm_75 has only "fma": whatever the dtype, Triton multiplies with fused multiply-adds there
        return dict(self.register_budget).get(kind, dict(self.register_budget).get("fma"))


#: Every architecture the kernels are compiled for offline (tests/test_compiled_archs.py).
_MMA_SYNC = (("mma", 96), ("tf32", 96), ("tf32x3", 32), ("fma", 64))
ARCHS = {
    75: Arch(75, "T4, RTX 20", 64 * 1024, 65536, (("fma", 64),)),
    80: Arch(80, "A100, A30", 163 * 1024, 65536, _MMA_SYNC),
    86: Arch(86, "RTX 30, A10, A40", 99 * 1024, 65536, _MMA_SYNC),
    89: Arch(89, "L4, L40, RTX 40", 99 * 1024, 65536, _MMA_SYNC),
    90: Arch(90, "H100, H200", 227 * 1024, 65536, (("mma", 160), ("tf32", 96), ("tf32x3", 48), ("fma", 64))),
}
#: The GPU the course is measured on, and whose rules the CPU shows (an H100/H200).
REFERENCE = ARCHS[90]


def arch_of(capability) -> Arch:
    """The table's entry for a compute capability ((8, 6) or 86): the newest listed one that is not
    newer (a GPU newer than sm_90 gets sm_90's rules; one older than sm_75 is refused)."""
    cc = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else int(capability)
    known = [c for c in ARCHS if c <= cc]
    if not known:
        raise RuntimeError(f"compute capability {cc / 10:.1f} is older than the oldest GPU flashattn supports "
                           f"(sm_75: {ARCHS[75].gpus})")
    return ARCHS[max(known)]


_assumed = None


def assume(arch):
    """Judge by ``arch`` instead of the running GPU (or None to stop): for compiling offline, where
    the process pretends to have a GPU it cannot ask."""
    global _assumed
    _assumed = arch


def device(index=None) -> Arch:
    """The running GPU's :class:`Arch`: its own shared memory and registers where PyTorch reports
    them, the table's register budgets for its architecture. A process that only compiles (a
    PyTorch without CUDA, or no GPU to ask) gets :data:`REFERENCE`."""
    if _assumed is not None:
        return _assumed
    if torch.version.cuda is None and torch.version.hip is None:
        return REFERENCE
    try:
        return _device(torch.cuda.current_device() if index is None else index)
    except (RuntimeError, AssertionError):  # CUDA built in but no GPU: a process that only compiles
        return REFERENCE


@functools.lru_cache(maxsize=None)
def _device(index):
    props = torch.cuda.get_device_properties(index)
    base = arch_of((props.major, props.minor))
    smem = getattr(props, "shared_memory_per_block_optin", 0) or base.smem_per_block
    regs = getattr(props, "regs_per_multiprocessor", 0) or base.regs_per_sm
    return Arch(props.major * 10 + props.minor, props.name, smem, regs, base.register_budget)


def current() -> Arch:
    """The running GPU's limits; on the interpreter, the reference GPU's (so that the CPU shows the
    rules of the GPU the course was measured on)."""
    return REFERENCE if INTERPRET and _assumed is None else device()
