"""Tile sizes, warps and pipeline stages: fixed on the CPU, measured on the GPU.

On a GPU each kernel is wrapped in ``triton.autotune``: the first call with a new key times every
candidate configuration that survives pruning and keeps the fastest. The key is the head dim, the
masking mode, the dot precision and the dtype, plus a *bucket* of the sequence length (the next
power of two, between 128 and 16384). So a new length re-uses the choice made for its bucket
instead of re-tuning (and the kernels take lengths as run-time arguments, so a new length does not
compile anything either).

On the interpreter nothing is timed (``num_warps`` and ``num_stages`` mean nothing there and every
tile costs Python time), so each kernel gets one fixed configuration. Setting the environment
variable ``FLASHATTN_AUTOTUNE=0`` does the same on a GPU: each kernel then runs the first
candidate that fits (no timing runs, fewer compilations), which is handy for quick checks.
"""
import os

import torch
import triton

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
#: operands and accumulators all sit in registers. Only small tiles avoid spilling (compiled for
#: sm_90 by tools/compile_check.py: 16 x 16 tiles use 80-110 registers, 32 x 32 spill).
FMA_CONFIGS = {
    "fwd": _configs((16, 16, 4, 2), (16, 16, 4, 3), (32, 16, 4, 2), (16, 32, 4, 2)),
    "bwd_preprocess": GPU_CONFIGS["bwd_preprocess"],
    "bwd_dkdv": _configs((16, 16, 4, 2), (16, 32, 8, 2), (16, 16, 4, 3)),
    "bwd_dq": _configs((32, 16, 4, 2), (16, 16, 4, 2), (32, 32, 4, 2), (64, 16, 8, 2)),
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
#: Compiled for sm_90: at head dim 128 only tiles of 16-32 rows avoid spilling.
TF32X3_CONFIGS = {
    "fwd": _configs((128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 3), (32, 32, 4, 2),
                    (32, 16, 4, 2)),
    "bwd_preprocess": GPU_CONFIGS["bwd_preprocess"],
    "bwd_dkdv": _configs((16, 64, 8, 2), (32, 32, 4, 2), (16, 32, 8, 2), (16, 16, 4, 2),
                         (16, 16, 8, 2)),
    "bwd_dq": _configs((64, 16, 4, 2), (32, 16, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2),
                       (16, 16, 4, 2)),
}
#: Values per thread that fp32 tiles may hold in registers before the compiler spills, by how
#: the dots multiply (compiled for sm_90: 16-bit tiles spill past ~160; TF32 operands are twice
#: the size; 3xTF32 also holds each operand's high and low parts).
REGISTER_BUDGET = {"tf32": 96, "tf32x3": 48}
#: Small tiles in one stage: what runs when no candidate is judged to fit (float32 at head dim 256).
FALLBACK_CONFIGS = {
    "fwd": triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 16}, num_warps=4, num_stages=1),
    "bwd_preprocess": triton.Config({"BLOCK_Q": 16}, num_warps=4, num_stages=1),
    "bwd_dkdv": triton.Config({"BLOCK_Q": 16, "BLOCK_KV": 32}, num_warps=4, num_stages=1),
    "bwd_dq": triton.Config({"BLOCK_Q": 32, "BLOCK_KV": 16}, num_warps=4, num_stages=1),
}


def candidates(name, dtype, dot_precision):
    """The candidate list for a kernel: GPU_CONFIGS for 16-bit inputs, and for float32 the list
    of its dot precision (FMA_CONFIGS for IEEE, TF32_CONFIGS, TF32X3_CONFIGS)."""
    if dtype != torch.float32 or dot_precision is None:
        return GPU_CONFIGS[name]
    return {"ieee": FMA_CONFIGS, "tf32": TF32_CONFIGS, "tf32x3": TF32X3_CONFIGS}[dot_precision][name]


def fits(name, config, block_d, element_size, dot_precision=None) -> bool:
    """Whether a candidate can run well on an H100/H200, judged before compiling it.

    ``tools/compile_check.py`` compiles every candidate for sm_90 and prints its registers and
    spills; these two rules are what those numbers showed.
    """
    bq, bkv = config.kwargs.get("BLOCK_Q", 0), config.kwargs.get("BLOCK_KV", 0)
    resident, streamed = (bkv, bq) if name == "bwd_dkdv" else (bq, bkv)
    # fp32 tiles held in registers: accumulators (resident x head dim: O; dK and dV; dQ) and
    # score-shaped tiles (resident x streamed: S; S and dP; S and dP). Past ~160 values per
    # thread the compiler spills them to local memory (fewer for float32 on tensor cores).
    accumulators, scores = {"fwd": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (1, 2)}[name]
    values = accumulators * resident * block_d + scores * resident * streamed
    budget = REGISTER_BUDGET.get(dot_precision, 160) if element_size == 4 else 160
    if values / (config.num_warps * 32) > budget:
        return False
    # Shared memory (227 KB per block) holds the resident tiles (Q; K and V; Q and dO) and, per
    # pipeline stage, two streamed ones (K and V; Q and dO; K and V).
    resident_tiles = 1 if name == "fwd" else 2
    smem = (resident_tiles * resident + config.num_stages * 2 * streamed) * block_d * element_size
    if smem > 227 * 1024:
        return False
    return name != "bwd_dkdv" or dkdv_steps_fit(bq, bkv)


def dkdv_steps_fit(block_q, block_kv) -> bool:
    """Whether BLOCK_Q divides BLOCK_KV, as the dK/dV kernel needs: it starts its query loop at
    the diagonal of its key block and steps through the queries BLOCK_Q at a time."""
    return block_kv % block_q == 0


def _prune(name):
    def prune(configs, named_args, **kwargs):  # Triton passes the constexprs in kwargs
        size, block_d = named_args["Q"].element_size(), kwargs["BLOCK_D"]
        precision = kwargs.get("DOT_PRECISION")
        return ([c for c in configs if fits(name, c, block_d, size, precision)]
                or [FALLBACK_CONFIGS[name]])
    return prune


_tuners = {}


def seq_bucket(seq_len: int) -> int:
    """The autotuning bucket of a sequence length: the next power of two, in [128, 16384]."""
    return min(max(triton.next_power_of_2(seq_len), 128), 16384)


def _quick_bench(fn, quantiles):
    # Shorter than do_bench's defaults (25 ms warm-up, 100 ms of runs): enough to rank candidates
    # that differ by a few percent, and four times less waiting on a first call.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _tuner(name, kernel, bucket, configs):
    key = (name, bucket, id(configs))  # one tuner per candidate list
    if key not in _tuners:
        _tuners[key] = triton.autotune(
            configs=configs,
            key=["HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"],  # dtypes are added by Triton itself
            prune_configs_by=None if name == "bwd_preprocess" else {"early_config_prune": _prune(name)},
            do_bench=_quick_bench,
        )(kernel)
    return _tuners[key]


def launch(name, kernel, grid, args, constexprs, seq_len, config=None):
    """Run ``kernel`` with ``config`` if given (the fixed one on the interpreter), with the first
    candidate that runs under FLASHATTN_AUTOTUNE=0, else autotuned. Returns the configuration that
    ran, as a dict."""
    if config is None and INTERPRET:
        config = INTERPRETER_CONFIGS[name]
    if config is not None:
        kernel[grid](*args, **constexprs, **config)
        return dict(config)
    configs = candidates(name, args[0].dtype, constexprs.get("DOT_PRECISION"))
    if os.environ.get("FLASHATTN_AUTOTUNE") == "0":
        return _first_that_runs(name, kernel, grid, args, constexprs, configs)
    tuner = _tuner(name, kernel, seq_bucket(seq_len), configs)
    tuner[grid](*args, **constexprs)
    best = tuner.best_config
    return dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)


def _first_that_runs(name, kernel, grid, args, constexprs, configs):
    """Without autotuning: the first candidate that fits (they are listed best first) and that
    the compiler accepts; small fallback tiles if none is judged to fit."""
    if name != "bwd_preprocess":
        size, precision = args[0].element_size(), constexprs.get("DOT_PRECISION")
        configs = ([c for c in configs if fits(name, c, constexprs["BLOCK_D"], size, precision)]
                   or [FALLBACK_CONFIGS[name]])
    for i, c in enumerate(configs):
        config = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        try:
            kernel[grid](*args, **constexprs, **config)
            return config
        except triton.runtime.errors.OutOfResources:
            if i == len(configs) - 1:
                raise


def block_d(head_dim: int) -> int:
    """Head dims are padded to a power of two of at least 16, the smallest tile tl.dot accepts."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies float32 tiles, following ``torch.get_float32_matmul_precision()``:

    * 'high' and 'medium' allow TF32 (10-bit mantissa products, fp32 accumulation), like
      PyTorch's own matmul: ``"tf32"``;
    * 'highest' (PyTorch's default) asks for float32 accuracy. On GPUs with tensor cores (sm_80
      and later) that is ``"tf32x3"``: each operand is split into a TF32 high part and a TF32
      low part and three tensor-core products are summed, which keeps float32's accuracy within
      the tolerance rule at several times the speed of float32 fused multiply-adds. Elsewhere
      (the interpreter, older GPUs, or FLASHATTN_TF32X3=0) it is ``"ieee"``.

    16-bit inputs always use their tensor-core path and ignore this."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    if dtype == torch.float32 and _tensor_cores() and os.environ.get("FLASHATTN_TF32X3") != "0":
        return "tf32x3"
    return "ieee"


def _tensor_cores() -> bool:
    """Whether the kernels run on a GPU with TF32 tensor cores (compute capability 8.0 or more)."""
    return not INTERPRET and torch.cuda.get_device_capability()[0] >= 8


# -- Decoding (flashattn.decode) ----------------------------------------------------------------
# A decode program keeps a tile of BLOCK_R query rows (the query heads of one KV head, times the new
# tokens) and streams its share of the K/V cache past it once. The loop is bound by memory, so the
# tile sizes are chosen for bytes in flight per SM (BLOCK_KV x stages), not for FLOPs. One fixed
# configuration runs (no autotuning: the split count depends on BLOCK_KV and must be known before
# the launch); DECODE_CANDIDATES are the ones the decode benchmark times side by side.

#: (BLOCK_KV, num_warps, num_stages) on a GPU with 16-bit inputs (or TF32), for query tiles of 16
#: rows (the query heads of a KV group times the new tokens, padded); the first is the default.
#: Compiled for sm_90 (tests/test_decode_compile.py --all), none spills; (64, 4, 4) takes 128
#: registers and 102 KB of shared memory, so two programs fit on an SM with 192 KB of K and V
#: tiles in flight between them.
DECODE_CANDIDATES = [(64, 4, 4), (64, 4, 3), (64, 8, 4), (128, 4, 3), (128, 4, 2), (128, 8, 3),
                     (32, 4, 4), (32, 4, 6)]
#: IEEE float32 multiplies with fused multiply-adds in registers: small key tiles and 8 warps
#: (at 4 warps, 32-key tiles spill at head dim 128; these take 64 registers, 109 at head dim 256).
DECODE_FMA_CONFIG = (16, 8, 2)
DECODE_INTERPRETER_CONFIG = dict(BLOCK_KV=16)


def decode_config(dtype, dot_precision, block_r, block_d, candidate=None):
    """The decode kernel's configuration as a dict (BLOCK_KV, num_warps, num_stages): the
    interpreter's, DECODE_FMA_CONFIG for IEEE float32, else ``candidate`` (default: the first of
    DECODE_CANDIDATES). Tall query tiles get smaller key tiles (the fp32 score tile
    BLOCK_R x BLOCK_KV stays at most 32 x 128) and more warps (at 64 rows and 4 warps the compiler
    needs 254 registers); the stages are cut to what shared memory holds (Triton keeps
    num_stages - 1 K and V tiles in flight: at most 160 KB)."""
    if INTERPRET:
        return dict(DECODE_INTERPRETER_CONFIG)
    if dtype == torch.float32 and dot_precision == "ieee":
        candidate = DECODE_FMA_CONFIG
    block_kv, warps, stages = candidate or DECODE_CANDIDATES[0]
    block_kv = max(16, min(block_kv, 32 * 128 // block_r))
    warps = max(warps, block_r // 8)
    stage_bytes = 2 * block_kv * block_d * dtype.itemsize
    while stages > 2 and (stages - 1) * stage_bytes > 160 * 1024:
        stages -= 1
    return dict(BLOCK_KV=block_kv, num_warps=warps, num_stages=stages)
