"""Tile sizes, warps and pipeline stages: the candidates, the rules that judge them, the defaults.

On a GPU each kernel runs a **default configuration**: the first candidate, in the order measured
fastest on an H200, that fits the running GPU by the rules of :func:`fits` (its shared memory and
its registers, from ``flashattn.gpu.archs``), with the winners the H200 measured per head dim for
sm_90 (:data:`MEASURED_DEFAULTS`). For the other architectures these defaults are reasoned (the
same order, pruned by that GPU's limits), not measured. Every one of them compiles for sm_75,
sm_80, sm_86, sm_89 and sm_90 within shared memory and without spilling under each Triton a
supported PyTorch pins, but for the spills ``flashattn.gpu.defaults.SPILLS`` records: the
experimental 3xTF32's at head dims 64 and 128, which no tile avoids or whose measured tiles ran
faster (tests/test_compiled_archs.py). How a launch
uses them, and autotuning, is ``flashattn.gpu.launch``.

Here too: how ``tl.dot`` multiplies float32 (:func:`dot_precision`) and the decode kernel's
configuration (:func:`decode_config`).
"""
import os
import warnings

import torch
import triton

from . import archs
from .defaults import DEFAULTS
from .runtime import INTERPRET

#: The configuration each kernel uses on the interpreter: small tiles, so that short test
#: sequences already have several blocks, a diagonal and a ragged end.
INTERPRETER_CONFIGS = {
    "fwd": dict(BLOCK_Q=32, BLOCK_KV=16),
    "bwd_preprocess": dict(BLOCK_Q=64),
    "bwd_dkdv": dict(BLOCK_KV=32, BLOCK_Q=16),
    "bwd_dq": dict(BLOCK_Q=32, BLOCK_KV=16),
}


def _configs(*specs):
    """Configs from (BLOCK_Q, BLOCK_KV, num_warps, num_stages) tuples."""
    return [triton.Config({"BLOCK_Q": bq, "BLOCK_KV": bkv}, num_warps=w, num_stages=s)
            for bq, bkv, w, s in specs]


#: Candidates on a GPU with tensor cores (16-bit inputs, or float32 allowed TF32), best first.
#: They are the fastest of a wider sweep on an H200 (figures/data/h200_tile_configs.csv: 21 to 30
#: candidates per kernel, bf16/fp16, head dims 64/128), plus small tiles for head dims up to 256.
#: In the forward and dQ kernels the query tile stays and key tiles stream past; in dK/dV the
#: key tile stays. FLASHATTN_AUTOTUNE=0 takes the first candidate that fits.
GPU_CONFIGS = {
    "fwd": _configs((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
                    (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 32, 4, 3),
                    (64, 32, 8, 2), (64, 32, 4, 2)),
    "bwd_preprocess": [triton.Config({"BLOCK_Q": b}, num_warps=4, num_stages=1) for b in (64, 128)],
    "bwd_dkdv": _configs((32, 64, 4, 4), (32, 64, 4, 3), (32, 128, 8, 3), (32, 128, 8, 4),
                         (64, 64, 4, 3), (64, 64, 4, 4), (16, 64, 4, 3), (16, 32, 4, 2)),
    "bwd_dq": _configs((128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (128, 32, 8, 3),
                       (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (32, 32, 4, 2)),
}
#: float32 in IEEE precision has no tensor-core path: tl.dot becomes fused multiply-adds, whose
#: operands and accumulators all sit in registers, so only tiles of a few thousand values avoid
#: spilling. Ordered by an H200's timings of float32 'highest' at head dims 64 and 128
#: (figures/data/h200_fp32_tiles.csv, tools/tile_sweep.py): 8 warps on 32 x 64 tiles ran the
#: forward 1.7x as fast as 4 warps on 16 x 16.
FMA_CONFIGS = {
    "fwd": _configs((32, 64, 8, 2), (64, 32, 8, 2), (32, 64, 8, 1), (16, 64, 8, 2), (16, 32, 4, 1),
                    (16, 16, 4, 2), (32, 16, 8, 2), (16, 16, 4, 1)),
    "bwd_preprocess": GPU_CONFIGS["bwd_preprocess"],
    "bwd_dkdv": _configs((32, 32, 8, 2), (32, 32, 8, 1), (16, 16, 4, 1), (16, 32, 8, 1), (16, 32, 8, 2),
                         (16, 16, 4, 2), (16, 64, 8, 2)),
    "bwd_dq": _configs((32, 64, 8, 2), (64, 32, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2), (16, 32, 8, 2),
                       (16, 16, 4, 2), (32, 16, 4, 2)),
}
#: float32 on TF32 tensor cores ('high', 'medium'): tiles twice the bytes of 16-bit ones, so half
#: as many fit in shared memory and registers. Chosen from compiling for sm_90 (no spills at head
#: dims 64 and 128 for the first of each list that ``fits``).
TF32_CONFIGS = {
    "fwd": _configs((128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (64, 32, 4, 2),
                    (64, 64, 4, 2)),
    "bwd_preprocess": GPU_CONFIGS["bwd_preprocess"],
    "bwd_dkdv": _configs((32, 64, 4, 3), (32, 128, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2),
                         (16, 32, 4, 2)),
    "bwd_dq": _configs((128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2),
                       (32, 32, 4, 2)),
}
#: float32 in 3xTF32 ('highest' on tensor cores): each product is three TF32 products (the high
#: parts together, and each high part with the other's low part), so the operands are split in
#: registers and shared memory and a tile costs about three times the registers of a TF32 one.
#: Compiled for sm_90: at head dim 128 only tiles of 16-32 rows avoid spilling. These candidates
#: were chosen when Triton split the operands itself (input_precision="tf32x3"); the kernels split
#: them by hand since (kernels.tiles.dot), and they have not been chosen again for that.
TF32X3_CONFIGS = {
    "fwd": _configs((128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 3), (32, 32, 4, 2),
                    (32, 16, 4, 2)),
    "bwd_preprocess": GPU_CONFIGS["bwd_preprocess"],
    "bwd_dkdv": _configs((16, 64, 8, 2), (32, 32, 4, 2), (16, 32, 8, 2), (16, 16, 4, 2),
                         (16, 16, 8, 2)),
    "bwd_dq": _configs((64, 16, 4, 2), (32, 16, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2),
                       (16, 16, 4, 2)),
}
#: Small tiles in one stage: what runs when no candidate is judged to fit (float32 at head dim 256).
FALLBACK_CONFIGS = {
    "fwd": triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 16}, num_warps=4, num_stages=1),
    "bwd_preprocess": triton.Config({"BLOCK_Q": 16}, num_warps=4, num_stages=1),
    "bwd_dkdv": triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 32}, num_warps=4, num_stages=1),
    "bwd_dq": triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 16}, num_warps=4, num_stages=1),
}


#: The defaults an H200 measured, by (compute capability, kernel, kind of dot, BLOCK_D): the default
#: there when it fits. 16-bit ("mma"): the winners of figures/data/h200_tile_configs.csv (the
#: autotuner's timings of every candidate at bf16/head dim 128 and fp16/head dim 64, N = 8192, causal
#: and not; where the two disagreed, the causal winner, within 3 % of the other). float32 IEEE
#: ("fma"): from figures/data/h200_fp32_tiles.csv (causal, N = 2048), the fastest configuration whose
#: compile took at most 3 s on that machine, so that a first call stays within 5 s (the backward's
#: kernels compile side by side, after about 0.8 s of Triton's own set-up). The one it passes over:
#: dQ at head dim 128 in 32 x 64 tiles, a backward 1.26x as fast, 3.6 s to compile (autotuning,
#: FLASHATTN_AUTOTUNE=1, finds it and keeps it on disk). 3xTF32 ("tf32x3"): the fastest of
#: TF32X3_CONFIGS that did not spill with Triton 3.6 in the tile sweep of
#: gpu-record/2026-12-02-1250-tile-sweep-tf32x3.txt (causal, N = 2048), except dK/dV at head dim
#: 64, whose 32 x 32 tiles on 4 warps spill 16 bytes and still ran the backward 1.5x as fast as
#: the best that does not (gpu-record/2026-12-02-1257-3xtf32-measured-tiles.txt).
MEASURED_DEFAULTS = {
    (90, "fwd", "tf32x3", 64): triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 32}, num_warps=8, num_stages=2),
    (90, "fwd", "tf32x3", 128): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 32}, num_warps=4, num_stages=3),
    (90, "bwd_dkdv", "tf32x3", 64): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 32}, num_warps=4, num_stages=2),
    (90, "bwd_dkdv", "tf32x3", 128): triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 16}, num_warps=8, num_stages=2),
    (90, "bwd_dq", "tf32x3", 64): triton.Config({"BLOCK_Q": 64, "BLOCK_KV": 16}, num_warps=4, num_stages=2),
    (90, "bwd_dq", "tf32x3", 128): triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 32}, num_warps=4, num_stages=2),
    (90, "fwd", "fma", 64): triton.Config({"BLOCK_Q": 64, "BLOCK_KV": 32}, num_warps=8, num_stages=2),
    (90, "fwd", "fma", 128): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 64}, num_warps=8, num_stages=2),
    (90, "bwd_dkdv", "fma", 64): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 32}, num_warps=8, num_stages=2),
    (90, "bwd_dkdv", "fma", 128): triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 32}, num_warps=8, num_stages=1),
    (90, "bwd_dq", "fma", 64): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 64}, num_warps=8, num_stages=2),
    (90, "bwd_dq", "fma", 128): triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 64}, num_warps=8, num_stages=2),
    (90, "bwd_dkdv", "mma", 64): triton.Config({"BLOCK_Q": 64, "BLOCK_KV": 64}, num_warps=4, num_stages=3),
    (90, "bwd_dkdv", "mma", 128): triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 64}, num_warps=4, num_stages=4),
    (90, "bwd_dq", "mma", 64): triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 64}, num_warps=8, num_stages=3),
    (90, "bwd_dq", "mma", 128): triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 64}, num_warps=8, num_stages=3),
    (90, "fwd", "mma", 64): triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 64}, num_warps=8, num_stages=3),
    (90, "fwd", "mma", 128): triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 64}, num_warps=8, num_stages=3),
    (90, "bwd_preprocess", "mma", 64): triton.Config({"BLOCK_Q": 64}, num_warps=4, num_stages=1),
    (90, "bwd_preprocess", "mma", 128): triton.Config({"BLOCK_Q": 64}, num_warps=4, num_stages=1),
}


def dot_kind(element_size, dot_precision, arch) -> str:
    """How ``tl.dot`` multiplies a kernel's tiles on ``arch``: "mma" (16-bit tensor cores), "tf32",
    "tf32x3", or "fma" (fused multiply-adds in registers: IEEE float32, and every dtype on GPUs
    before sm_80, where Triton emits no tensor-core instruction)."""
    if not arch.tensor_cores or (element_size == 4 and dot_precision == "ieee"):
        return "fma"
    if element_size == 4 and dot_precision in ("tf32", "tf32x3"):
        return dot_precision
    return "mma"


def candidates(name, dtype, dot_precision, arch=None):
    """The candidate list for a kernel: GPU_CONFIGS for 16-bit inputs, and for float32 the list
    of its dot precision (FMA_CONFIGS for IEEE, TF32_CONFIGS, TF32X3_CONFIGS); FMA_CONFIGS for
    every dtype on a GPU without tensor cores (``arch``: default, the running GPU)."""
    arch = arch or archs.current()
    kind = dot_kind(torch.empty((), dtype=dtype).element_size(), dot_precision, arch)
    return {"mma": GPU_CONFIGS, "fma": FMA_CONFIGS, "tf32": TF32_CONFIGS, "tf32x3": TF32X3_CONFIGS}[kind][name]


def fits(name, config, block_d, element_size, dot_precision=None, arch=None) -> bool:
    """Whether a candidate can run well on ``arch`` (default: the running GPU; on the CPU, an
    H100/H200), judged before compiling it.

    ``tools/compile_check.py`` compiles every candidate for each architecture and prints its
    registers and spills; these two rules are what those numbers showed.
    """
    arch = arch or archs.current()
    bq, bkv = config.kwargs.get("BLOCK_Q", 0), config.kwargs.get("BLOCK_KV", 0)
    resident, streamed = (bkv, bq) if name == "bwd_dkdv" else (bq, bkv)
    # fp32 tiles held in registers: accumulators (resident x head dim: O; dK and dV; dQ) and
    # score-shaped tiles (resident x streamed: S; S and dP; S and dP). Past a budget of values per
    # thread the compiler spills them to local memory: ~160 on sm_90 for 16-bit tiles, fewer where
    # the dot holds its operands in registers too (archs.ARCHS).
    accumulators, scores = {"fwd": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (1, 2)}[name]
    values = accumulators * resident * block_d + scores * resident * streamed
    if values / (config.num_warps * 32) > arch.budget(dot_kind(element_size, dot_precision, arch)):
        return False
    # Shared memory (227 KB per block on sm_90) holds the resident tiles (Q; K and V; Q and dO) and,
    # per pipeline stage, two streamed ones (K and V; Q and dO; K and V).
    resident_tiles = 1 if name == "fwd" else 2
    smem = (resident_tiles * resident + config.num_stages * 2 * streamed) * block_d * element_size
    if smem > arch.smem_per_block:
        return False
    if dot_precision == "tf32x3" and not tf32x3_warps_fit(resident, config.num_warps):
        return False
    return name != "bwd_dkdv" or dkdv_steps_fit(bq, bkv)


def tf32x3_warps_fit(rows, num_warps) -> bool:
    """Whether 3xTF32 products with ``rows`` rows (the resident tile) may run on ``num_warps``.

    A compiler fault, excluded by this rule: on an H200 (triton 3.6, 2026-12-01) the dK/dV
    candidate of 16 x 64 tiles with 8 warps returned dK and dV wrong by up to 30 at head dims 24
    and 32 (the worst case of the float32 grid, 782749 times the rule's bound) and hit an illegal
    memory access at head dims 40 and 64; it was right at 1-16. Compiled for sm_90 (triton 3.6 and
    3.7.1), it is the only float32 candidate whose wgmma products (64 rows and more) have fewer
    rows than 16 per warp: the compiler puts both warpgroups on the same 64 rows for two of the
    three TF32 products of each 3xTF32 dot (warpsPerCTA [8, 1]) and splits the columns for the
    third ([4, 2]), so every accumulator changes layout between them; 16-bit and TF32 dots keep
    one layout per product. Smaller tiles multiply with mma.sync instead and are not concerned.
    The kernels now split the operands by hand (kernels.tiles.dot: three plain TF32 dots), which
    this fault did not concern; the rule is kept until the candidates are chosen again."""
    return rows < 64 or rows >= 16 * num_warps


def ranked(name, dtype, dot_precision, block_d, arch=None):
    """The configurations to run ``name`` with, best first: the measured default where there is
    one, then every candidate that fits ``arch`` (default: the running GPU), in the candidate
    list's order; the small fallback tiles if none fits."""
    arch = arch or archs.current()
    configs = candidates(name, dtype, dot_precision, arch)
    if name == "bwd_preprocess":  # no tiles of scores: every candidate fits
        return list(configs)
    size = torch.empty((), dtype=dtype).element_size()
    fitting = [c for c in configs if fits(name, c, block_d, size, dot_precision, arch)]
    measured = MEASURED_DEFAULTS.get((arch.capability, name, dot_kind(size, dot_precision, arch), block_d))
    if measured is not None and fits(name, measured, block_d, size, dot_precision, arch):
        fitting = [measured] + [c for c in fitting if as_dict(c) != as_dict(measured)]
    return fitting or [FALLBACK_CONFIGS[name]]


#: The last resort of ``tools/compile_check.py --write-defaults`` where every candidate spills
#: (16 warps: fused multiply-adds at head dim 256 on sm_75).
SMALLEST_CONFIGS = _configs((16, 16, 4, 1), (16, 16, 8, 1), (16, 16, 8, 2), (16, 16, 16, 1))
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
WHAT = {"fwd": "forward", "bwd_preprocess": "backward (Delta)", "bwd_dkdv": "backward (dK, dV)",
        "bwd_dq": "backward (dQ)"}


def default_config(name, dtype, dot_precision, block_d, arch=None):
    """The configuration ``name`` runs with when nothing is timed: on an architecture of
    ``flashattn.defaults`` (compiled for it without spilling), its entry; on any other GPU, the
    first of :func:`ranked`. Raises ValueError, naming the GPU, where no tile compiles cleanly for it."""
    arch = arch or archs.current()
    precision = None if name == "bwd_preprocess" else dot_precision
    entries = DEFAULTS.get(arch.capability, {}).get((name, DTYPE_NAMES[dtype], precision), {})
    if block_d in entries and entries[block_d] is None:
        raise ValueError(f"{arch.gpus} ({arch.name}) has too little room for flashattn's {WHAT[name]} at head "
                         f"dims {block_d // 2 + 1} to {block_d}: even its smallest tiles spill registers or need "
                         f"more than the {arch.smem_per_block // 1024} KB of shared memory a block may use "
                         f"there. Use head dims up to {block_d // 2} on this GPU.")
    if block_d not in entries:
        return ranked(name, dtype, dot_precision, block_d, arch)[0]
    block_q, block_kv, num_warps, num_stages = entries[block_d]
    tiles = {"BLOCK_Q": block_q, **({"BLOCK_KV": block_kv} if block_kv else {})}
    return triton.Config(tiles, num_warps=num_warps, num_stages=num_stages)


def dkdv_steps_fit(block_q, block_kv) -> bool:
    """Whether BLOCK_Q divides BLOCK_KV, as the dK/dV kernel needs: it starts its query loop at
    the diagonal of its key block and steps through the queries BLOCK_Q at a time."""
    return block_kv % block_q == 0


def as_dict(config):
    """A ``triton.Config`` as the keyword arguments of a launch: tiles, ``num_warps``, ``num_stages``."""
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two of at least 16, the smallest tile tl.dot accepts."""
    return max(16, triton.next_power_of_2(head_dim))


def head_dims(head_dim: int, head_dim_v: int) -> dict:
    """The kernels' head-dim constexprs: HEAD_DIM and BLOCK_D for Q and K (S = Q K^T, dQ, dK),
    HEAD_DIM_V and BLOCK_DV for V, O and dO (O = P V, Delta, dP = dO V^T, dV)."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
                HEAD_DIM_V=head_dim_v, BLOCK_DV=block_d(head_dim_v))


def tile_block_d(constexprs) -> int:
    """The BLOCK_D a kernel's tiles are configured by: the wider of its two padded head dims.

    The candidates, their rules (:func:`fits`) and the defaults were chosen and compiled with Q, K,
    V and O tiles of one width. A kernel whose V tiles are narrower or wider than its Q and K tiles
    holds at most what the one-width kernel of the wider of the two holds, in registers and in
    shared memory, so that kernel's configuration fits it too (e.g. 192/128, DeepSeek's MLA, is
    configured as 256)."""
    return max(constexprs.get("BLOCK_D", 0), constexprs.get("BLOCK_DV", 0))


#: 3xTF32 holds each operand's high and low parts: past this BLOCK_D the backward kernels spill
#: with any tile (compiled for sm_80 to sm_90), so 'highest' float32 multiplies in IEEE there.
TF32X3_MAX_BLOCK_D = 128


def dot_precision(dtype: torch.dtype, block_d=None) -> str:
    """How tl.dot multiplies float32 tiles, following ``torch.get_float32_matmul_precision()``:

    * 'high' and 'medium' allow TF32 (10-bit mantissa products, fp32 accumulation), like
      PyTorch's own matmul: ``"tf32"``;
    * 'highest' (PyTorch's default) asks for float32 accuracy: ``"ieee"``, float32 fused
      multiply-adds. 3xTF32 (``"tf32x3"``: each operand split into a TF32 high and low part, three
      tensor-core products summed, by hand in ``kernels.tiles.dot``) is taken only when
      FLASHATTN_TF32X3=1 asks for it, on GPUs with tensor cores and head dims up to
      ``TF32X3_MAX_BLOCK_D``. It is experimental: Triton's own split gave wrong gradients on some
      tiles on an H200; the split by hand, both parts rounded to nearest, is within the rule on
      the whole float32 test grid there and faster than IEEE, but it was checked on no other GPU
      and its backward runs at 0.2-0.5x SDPA's float32 (docs/performance.md), so
      :func:`warn_tf32x3` warns once when it is used.

    GPUs before sm_80 have no TF32: there float32 is always ``"ieee"``. 16-bit inputs always use
    their tensor-core path and ignore this."""
    if dtype != torch.float32 or (not INTERPRET and not archs.device().tensor_cores):
        return "ieee"
    if torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    if (tf32x3_asked() and _tensor_cores()
            and (block_d is None or block_d <= TF32X3_MAX_BLOCK_D)):
        warn_tf32x3()
        return "tf32x3"
    return "ieee"


def tf32x3_asked() -> bool:
    """Whether FLASHATTN_TF32X3=1 asks 'highest' float32 to run as 3xTF32 (off by default)."""
    return os.environ.get("FLASHATTN_TF32X3", "0") == "1"


_TF32X3_WARNED = []


def warn_tf32x3():
    """Warn, once per process, that 3xTF32 is experimental."""
    if not _TF32X3_WARNED:
        _TF32X3_WARNED.append(True)
        warnings.warn("FLASHATTN_TF32X3=1: float32 at 'highest' runs as 3xTF32, which is "
                      "experimental: checked on an H200 only (docs/performance.md). Unset it for "
                      "IEEE float32.",
                      RuntimeWarning, stacklevel=3)


def _tensor_cores() -> bool:
    """Whether the kernels run on a GPU with TF32 tensor cores (compute capability 8.0 or more)."""
    return not INTERPRET and archs.device().tensor_cores


# -- Decoding (flashattn.decode) ----------------------------------------------------------------
# A decode program keeps a tile of BLOCK_R query rows (the query heads of one KV head, times the new
# tokens) and streams its share of the K/V cache past it once. The loop is bound by memory, so the
# tile sizes are chosen for bytes in flight per SM (BLOCK_KV x stages), not for FLOPs. One fixed
# configuration runs (no autotuning: the split count depends on BLOCK_KV and must be known before
# the launch); DECODE_CANDIDATES are the ones the decode benchmark times side by side.

#: (BLOCK_KV, num_warps, num_stages) on a GPU with 16-bit inputs (or TF32), for query tiles of 16
#: rows (the query heads of a KV group times the new tokens, padded); the first is the default.
#: Compiled for sm_90 (python tools/compile_check.py --kernel decode_split --all), none spills;
#: (64, 4, 4) takes 128 registers and 102 KB of shared memory, so two programs fit on an SM with
#: 192 KB of K and V tiles in flight between them.
DECODE_CANDIDATES = [(64, 4, 4), (64, 4, 3), (64, 8, 4), (128, 4, 3), (128, 4, 2), (128, 8, 3),
                     (32, 4, 4), (32, 4, 6)]
#: IEEE float32 multiplies with fused multiply-adds in registers: small key tiles and 8 warps
#: (at 4 warps, 32-key tiles spill at head dim 128; these take 64 registers, 109 at head dim 256).
DECODE_FMA_CONFIG = (16, 8, 2)
DECODE_INTERPRETER_CONFIG = dict(BLOCK_KV=16)


def decode_precision(dtype):
    """How the decode kernel multiplies: as :func:`dot_precision`, except that float32 asked to
    keep float32's accuracy ('highest') is multiplied in IEEE float32 rather than 3xTF32. A
    decoding step is bound by reading the cache, and 3xTF32's split operands cost more registers
    and shared memory than a decode tile can spare (compiled for sm_90: spills from head dim 128
    on, and 256 KB of shared memory for 64 rows at head dim 128, past the 227 KB of a block)."""
    precision = dot_precision(dtype)
    return "ieee" if precision == "tf32x3" else precision


def decode_config(dtype, dot_precision, block_r, block_d, candidate=None, arch=None, paged=False):
    """The decode kernel's configuration as a dict (BLOCK_KV, num_warps, num_stages): the
    interpreter's, DECODE_FMA_CONFIG for IEEE float32 (and every dtype on a GPU without tensor
    cores), else ``candidate`` (default: the first of DECODE_CANDIDATES). Tall query tiles get
    smaller key tiles (the fp32 score tile BLOCK_R x BLOCK_KV stays at most 32 x 128) and more warps
    (8 from 32 rows on: at 64 rows and 4 warps the compiler needs 254 registers, and at 32 rows
    Triton 3.6's spills 8 bytes per thread at head dim 128); the stages are cut to what shared
    memory holds (Triton keeps num_stages - 1 K and V tiles in flight: at most 70 % of what a block
    may use on ``arch``, 160 KB on sm_90, leaving the rest to the query tile and the compiler), then
    the stages and key tiles to what the whole block fits in (on GPUs of 100 KB a block, head dim
    256 takes smaller key tiles).
    A ``paged`` cache halves that bound (at most 64 x 32): the gathered rows' 64-bit offsets cost
    registers, and 64 x 64 tiles spill on sm_80 and sm_89 (tests/test_decode_compile.py);
    Triton 3.6 spills at 32 x 64 (16-bit, head dim 128) and 64 x 32 (256, before sm_90) too: 32 and
    16 keys there."""
    if INTERPRET:
        return dict(DECODE_INTERPRETER_CONFIG)
    arch = arch or archs.current()
    if not arch.tensor_cores or (dtype == torch.float32 and dot_precision == "ieee"):
        candidate = DECODE_FMA_CONFIG
    block_kv, warps, stages = candidate or DECODE_CANDIDATES[0]
    block_kv = max(16, min(block_kv, (16 if paged else 32) * 128 // block_r))
    # and where Triton 3.6 spills 8-24 bytes even so: 32 x 64 at head dim 128 (sm_90), 64 x 32 at 256
    if paged and block_r >= 32 and block_d == 128 and dtype.itemsize == 2:
        block_kv = min(block_kv, 32)
    if paged and block_r >= 64 and block_d >= 256 and arch.capability < 90:
        block_kv = 16
    warps = max(warps, 8 if block_r >= 32 else 4)
    # TF32 tiles of 32 rows at head dim 256 spill at 4 warps (8 above) and, before sm_90, at 32 keys
    # (24 bytes on sm_80); of 16 rows they spill at 8 warps (sm_89, Triton 3.7.1), so keep 4 there
    if dtype == torch.float32 and block_d >= 256 and block_r >= 32 and arch.capability < 90:
        block_kv = 16
    def in_flight():  # the K and V tiles Triton keeps in shared memory
        return (stages - 1) * 2 * block_kv * block_d * dtype.itemsize

    def held():  # and the query tile and the float32 score tile beside them
        return in_flight() + block_r * (block_d * dtype.itemsize + block_kv * 4)

    while stages > 2 and in_flight() > arch.smem_per_block * 7 // 10:
        stages -= 1
    # then all of it within the block's shared memory, 4 KB to spare (at head dim 256 one stage of
    # K/V tiles alone can fill a GPU of 100 KB a block)
    while held() > arch.smem_per_block - 4096 and (stages > 2 or block_kv > 16):
        if stages > 2:
            stages -= 1
        else:
            block_kv //= 2
    return dict(BLOCK_KV=block_kv, num_warps=warps, num_stages=stages)
