"""Checkers of chapter 09: counting an attention's FLOPs and minimal bytes, the registers and shared
memory a tile configuration needs (the rule of ``flashattn.gpu.configs.fits``, spelled out), and
choosing a configuration for an H100/H200.
"""
import math

import torch
import triton

from ...gpu import archs, configs
from ...measure.bench import attention_flops
from .common import ExerciseError, attempt, passed

VALUES_PER_THREAD = 160      # fp32 values a thread holds before the compiler spills (configs.fits)
SMEM_PER_BLOCK = 227 * 1024  # shared memory one block may use on an H100/H200 (configs.fits)
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


def _dtype_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def minimal_bytes(batch, heads, n_q, n_kv, head_dim, mode, element_size, lse_size=4, count_lse=True):
    """The fewest bytes attention can move to or from HBM: every input read once and every output
    written once. Forward: Q, K, V read and O written (``element_size`` bytes each), the LSE written
    (float32, one per query row). Backward: Q, K, V, O, dO and the LSE read; dQ, dK, dV written.
    Intermediates of one implementation (Delta) are not counted."""
    bh = batch * heads
    rows = 2 * n_q + 2 * n_kv if mode == "fwd" else 4 * n_q + 4 * n_kv
    return bh * rows * head_dim * element_size + (lse_size * bh * n_q if count_lse else 0)


def _number(value, what):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ExerciseError(f"{what} should be a number, got {type(value).__name__}") from None


def check_attention_cost(attention_cost):
    """Chapter 09: ``attention_cost(batch, heads, n_q, n_kv, head_dim, causal, mode, dtype)`` must
    return ``(flops, bytes)``: the conventional FLOP count (``flashattn.measure.bench.attention_flops``) and
    the minimal HBM bytes (every input read once, every output written once; the LSE in float32)."""
    name = getattr(attention_cost, "__name__", "attention_cost")
    cases = [(1, 1, 64, 64, 64, False, "fwd", torch.bfloat16),
             (1, 128, 8192, 8192, 128, True, "fwd", torch.bfloat16),
             (2, 16, 4096, 4096, 128, True, "bwd", torch.float16),
             (4, 8, 1000, 3000, 80, False, "bwd", torch.float32),
             (3, 5, 777, 129, 96, True, "fwd", torch.float32),
             (2, 4, 17, 300, 40, True, "bwd", torch.float16),
             (1, 32, 16384, 16384, 64, False, "fwd", torch.float16),
             (5, 3, 2048, 512, 256, False, "bwd", torch.bfloat16)]
    for b, h, n_q, n_kv, d, causal, mode, dtype in cases:
        call = (f"{name}({b}, {h}, {n_q}, {n_kv}, {d}, causal={causal}, mode={mode!r}, "
                f"dtype={dtype})")
        out = attempt(attention_cost, b, h, n_q, n_kv, d, causal, mode, dtype, name=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{call} should return a tuple (flops, bytes), got {type(out).__name__}"
                                + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""))
        flops, n_bytes = _number(out[0], f"{call}[0] (the FLOPs)"), _number(out[1], f"{call}[1] (the bytes)")
        e = _dtype_size(dtype)

        want = attention_flops(b, h, n_q, n_kv, d, causal, mode)
        if not math.isclose(flops, want, rel_tol=1e-9):
            full = attention_flops(b, h, n_q, n_kv, d, False, mode)
            fwd = attention_flops(b, h, n_q, n_kv, d, causal, "fwd")
            hints = [
                (causal, full, "that is the count WITHOUT the causal halving: causal attention is "
                               "credited half the work (x0.5), since about half of the (i, j) pairs are hidden"),
                (mode == "bwd", fwd, "that is the forward's count: the backward is credited 2.5x the "
                                     "forward (5 matrix products against 2)"),
                (mode == "bwd", fwd * 2, "the backward does 5 matrix products (S again, dV, dP, dQ, dK), "
                                         "2.5x the forward's 2, not 2x"),
                (mode == "bwd", fwd * 3.5, "that counts 7 products per tile pair, which is what flashattn's "
                                           "deterministic backward really does; the convention credits 5 "
                                           "(2.5x the forward) whatever the implementation"),
                (True, want / 2, "each multiply-add is 2 FLOPs: one product of (N_q x D) by (D x N_kv) "
                                 "costs 2 * N_q * N_kv * D"),
                (n_q != n_kv, want * n_q / n_kv, "use N_q * N_kv, not N_q squared"),
                (n_q != n_kv, want * n_kv / n_q, "use N_q * N_kv, not N_kv squared"),
                (b > 1, want / b, "multiply by the batch size too"),
                (h > 1, want / h, "multiply by the number of heads too"),
            ]
            hint = "; or else, ".join(dict.fromkeys(text for applies, value, text in hints
                                                    if applies and math.isclose(flops, value, rel_tol=1e-9)))
            raise ExerciseError(f"{call}: FLOPs {flops:.6g}, expected {want:.6g}"
                                + (f": {hint}" if hint else " (4 * B * H * N_q * N_kv * D, x0.5 if causal, "
                                   "x2.5 for the backward)"))

        want_b = minimal_bytes(b, h, n_q, n_kv, d, mode, e)
        if n_bytes != want_b:
            bh = b * h
            hints = [
                (causal, want_b / 2, "the causal mask halves the FLOPs, not the bytes: every row of K and V "
                                     "is still read by some query, every row of Q and O still exists"),
                (causal, (want_b - 4 * bh * n_q) / 2 + 4 * bh * n_q,
                 "the causal mask halves the FLOPs, not the bytes: every row of K and V is still read"),
                (True, want_b - 4 * bh * n_q, "the LSE is missing: one float32 per query row, written by the "
                                              "forward and read by the backward"),
                (e != 4, want_b - 4 * bh * n_q + e * bh * n_q, "the LSE is float32 (4 bytes per row) "
                                                               "whatever the dtype of Q, K, V"),
                (e != 4, minimal_bytes(b, h, n_q, n_kv, d, mode, 4), f"that assumes 4 bytes per element; {dtype} "
                                                                   f"has {e} (torch.empty((), dtype=dtype).element_size())"),
                (True, want_b * 8, "that is bits; count bytes"),
                (mode == "bwd", minimal_bytes(b, h, n_q, n_kv, d, "fwd", e),
                 "that is the forward's traffic: the backward reads Q, K, V, O, dO and the LSE and writes "
                 "dQ, dK and dV"),
                (mode == "bwd", want_b + 4 * bh * n_q, "Delta is an intermediate of one implementation (it "
                                                       "could be computed on the fly); count only inputs and outputs"),
                (mode == "bwd", want_b + 8 * bh * n_q, "Delta is an intermediate of one implementation (it "
                                                       "could be computed on the fly); count only inputs and outputs"),
                (n_q != n_kv, minimal_bytes(b, h, n_kv, n_q, d, mode, e), "N_q and N_kv are swapped: Q, O (and "
                                                                        "dQ, dO) have N_q rows, K and V N_kv"),
            ]
            hint = "; or else, ".join(dict.fromkeys(text for applies, value, text in hints
                                                    if applies and n_bytes == value))
            raise ExerciseError(f"{call}: bytes {n_bytes:,.0f}, expected {want_b:,}"
                                + (f": {hint}" if hint else
                                   " (count each tensor read or written once: e bytes per element, float32 LSE)"))
    passed(f"{name} gives the FLOPs and the minimal bytes on {len(cases)} settings (forward and backward, "
           "causal or not, N_q != N_kv, fp16/bf16/fp32, head dims 40 to 256)")


def resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                    pad=True, accumulators=None, dkdv_resident_kv=True, kv_per_stage=2,
                    resident_tiles=None):
    """The two numbers flashattn.gpu.configs.fits judges a configuration by: fp32 values per thread
    held in registers, and shared-memory bytes. The keywords reproduce known mistakes."""
    bd = configs.block_d(head_dim) if pad else head_dim
    resident, streamed = ((block_kv, block_q) if kernel == "bwd_dkdv" and dkdv_resident_kv
                          else (block_q, block_kv))
    acc, scores = accumulators or {"fwd": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (1, 2)}[kernel]
    values = (acc * resident * bd + scores * resident * streamed) / (num_warps * 32)
    if resident_tiles is None:
        resident_tiles = 1 if kernel == "fwd" else 2
    smem = (resident_tiles * resident + num_stages * kv_per_stage * streamed) * bd * element_size
    return values, smem


def rule_fits(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size):
    values, smem = resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size)
    divides = kernel != "bwd_dkdv" or configs.dkdv_steps_fit(block_q, block_kv)
    return values <= VALUES_PER_THREAD and smem <= SMEM_PER_BLOCK and divides


def resource_cases():
    """(kernel, BLOCK_Q, BLOCK_KV, head_dim, num_warps, num_stages, element_size): every candidate
    of flashattn.gpu.configs (tensor-core and FMA lists) at several head dims and element sizes."""
    cases = []
    for kernel in KERNELS:
        candidates = configs.GPU_CONFIGS[kernel] + configs.FMA_CONFIGS[kernel]
        for head_dim in (16, 40, 64, 80, 128, 192, 256):
            for element_size in (2, 4):
                for c in candidates:
                    cases.append((kernel, c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_KV"], head_dim,
                                  c.num_warps, c.num_stages, element_size))
    return cases


def check_estimate_resources(estimate_resources):
    """Chapter 09: ``estimate_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages,
    element_size)`` must return ``(values_per_thread, smem_bytes)`` as flashattn.gpu.configs.fits counts
    them, for kernel "fwd", "bwd_dkdv" or "bwd_dq"."""
    name = getattr(estimate_resources, "__name__", "estimate_resources")
    cases = resource_cases()
    over_registers = over_smem = 0
    for kernel, bq, bkv, hd, warps, stages, e in cases:
        call = f"{name}({kernel!r}, {bq}, {bkv}, head_dim={hd}, num_warps={warps}, num_stages={stages}, element_size={e})"
        out = attempt(estimate_resources, kernel, bq, bkv, hd, warps, stages, e, name=name)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ExerciseError(f"{call} should return a tuple (values_per_thread, smem_bytes), got "
                                f"{type(out).__name__}")
        values, smem = _number(out[0], f"{call}[0]"), _number(out[1], f"{call}[1]")
        want_v, want_s = resources(kernel, bq, bkv, hd, warps, stages, e)
        # The reference must say what the package says (it is the package's rule, spelled out).
        config = triton_config(bq, bkv, warps, stages)
        package_says = configs.fits(kernel, config, configs.block_d(hd), e, arch=archs.REFERENCE)  # an H100/H200
        assert rule_fits(kernel, bq, bkv, hd, warps, stages, e) == package_says, \
            "flashattn.gpu.configs.fits has changed: update resources"
        over_registers += want_v > VALUES_PER_THREAD
        over_smem += want_s > SMEM_PER_BLOCK
        mistake = dict(
            no_pad=(hd != configs.block_d(hd), resources(kernel, bq, bkv, hd, warps, stages, e, pad=False),
                    f"the tiles are BLOCK_D = {configs.block_d(hd)} wide, not head_dim = {hd}: the kernels pad the "
                    "head dim to a power of two of at least 16 (flashattn.gpu.configs.block_d)"),
            swapped=(kernel == "bwd_dkdv" and bq != bkv,
                     resources(kernel, bq, bkv, hd, warps, stages, e, dkdv_resident_kv=False),
                     "in the dK/dV kernel the KEY tile is resident (BLOCK_KV rows stay) and query tiles "
                     "(BLOCK_Q rows) stream past it"),
            one_acc=(kernel != "fwd", resources(kernel, bq, bkv, hd, warps, stages, e, accumulators=(1, 1)),
                     "dK/dV accumulates two tiles (dK and dV) and holds two score-shaped ones (S and dP); dQ "
                     "accumulates one (dQ) but also holds two score-shaped ones (S and dP)"),
        )
        for value, want, what, limit in ((values, want_v, "fp32 values per thread", "registers"),
                                         (smem, want_s, "shared-memory bytes", "shared memory")):
            index = 0 if limit == "registers" else 1
            if math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-9):
                continue
            hint = next((text for applies, wrong, text in mistake.values()
                         if applies and math.isclose(value, wrong[index], rel_tol=1e-9)
                         and not math.isclose(wrong[index], want, rel_tol=1e-9)), None)
            if hint is None and index == 0:
                hint = {want * 32: "that is per warp: divide by the threads, num_warps * 32",
                        want * warps * 32: "that is per block: divide by the threads, num_warps * 32",
                        want * 4: "count values (4-byte fp32 numbers), not bytes"}.get(value)
            if hint is None and index == 1:
                resident_tiles = 1 if kernel == "fwd" else 2
                wrong = {
                    resources(kernel, bq, bkv, hd, warps, stages, e, kv_per_stage=1)[1]:
                        "each pipeline stage holds TWO streamed tiles (K and V in the forward and dQ kernels, "
                        "Q and dO in dK/dV)",
                    resources(kernel, bq, bkv, hd, warps, stages, e, resident_tiles=0)[1]:
                        "the resident tile(s) live in shared memory too (Q in the forward; two in the backward)",
                    resources(kernel, bq, bkv, hd, warps, stages, 4)[1]:
                        f"the tiles are stored in the input dtype, {e} bytes per element, not as float32",
                    resources(kernel, bq, bkv, hd, warps, stages, e,
                                    resident_tiles=3 - resident_tiles if kernel != "fwd" else 2)[1]:
                        "the forward keeps one resident tile (Q), the backward kernels two (K and V; Q and dO)",
                    want * 8: "that is bits; count bytes",
                }
                wrong.pop(want, None)
                hint = wrong.get(value)
            raise ExerciseError(f"{call}: {what} {value:,.6g}, expected {want:,.6g}"
                                + (f": {hint}" if hint else f" (the {limit} rule of flashattn.gpu.configs.fits)"))
    passed(f"{name} counts registers and shared memory like flashattn.gpu.configs.fits on {len(cases)} cases "
           f"(3 kernels, head dims 16 to 256, 2- and 4-byte inputs; {over_registers} over the register "
           f"limit, {over_smem} over the shared-memory limit)")


def triton_config(block_q, block_kv, num_warps, num_stages):
    """A triton.Config with these tiles, as flashattn.gpu.configs lists them."""
    return triton.Config({"BLOCK_Q": block_q, "BLOCK_KV": block_kv}, num_warps=num_warps, num_stages=num_stages)


BLOCKS = (16, 32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (1, 2, 3, 4)


def _fitting(kernel, head_dim, element_size):
    """Every configuration of the exercise's grid that fits, as (BLOCK_Q, BLOCK_KV, warps, stages)."""
    return [(bq, bkv, w, s) for bq in BLOCKS for bkv in BLOCKS for w in WARPS
            for s in STAGES if rule_fits(kernel, bq, bkv, head_dim, w, s, element_size)]


def _why_not(kernel, bq, bkv, head_dim, warps, stages, e):
    """Which limit a configuration breaks, in words (None if it fits)."""
    values, smem = resources(kernel, bq, bkv, head_dim, warps, stages, e)
    reasons = []
    if values > VALUES_PER_THREAD:
        reasons.append(f"registers: it holds {values:.0f} fp32 values per thread (accumulators and score tiles "
                       f"spread over {warps * 32} threads), more than ~{VALUES_PER_THREAD} before the "
                       "compiler spills; use more warps or smaller tiles")
    if smem > SMEM_PER_BLOCK:
        reasons.append(f"shared memory: resident tile(s) plus {stages} stage(s) of two streamed tiles, "
                       f"BLOCK_D = {configs.block_d(head_dim)} wide at {e} bytes, make {smem:,.0f} bytes, more than the "
                       f"{SMEM_PER_BLOCK:,} (227 KB) one block may use; use fewer stages or a smaller "
                       "streamed tile")
    if kernel == "bwd_dkdv" and not configs.dkdv_steps_fit(bq, bkv):
        reasons.append("the dK/dV kernel steps through the queries from the diagonal: BLOCK_Q must divide BLOCK_KV")
    return "; and ".join(reasons) or None


def check_choose_config(choose_config):
    """Chapter 09: ``choose_config(kernel, head_dim, element_size)`` must return a dict with BLOCK_Q,
    BLOCK_KV (powers of two, 16 to 256), num_warps (4 or 8) and num_stages (1 to 4) that fits an
    H100/H200 by flashattn.gpu.configs.fits and whose score tile holds at least 64 x 64 elements (or as
    many as any fitting configuration can, where 64 x 64 does not fit)."""
    name = getattr(choose_config, "__name__", "choose_config")
    chosen = {}
    for kernel in KERNELS:
        for head_dim in (16, 64, 80, 128, 192, 256):
            for e in (2, 4):
                call = f"{name}({kernel!r}, head_dim={head_dim}, element_size={e})"
                config = attempt(choose_config, kernel, head_dim, e, name=name)
                if not isinstance(config, dict):
                    raise ExerciseError(f"{call} should return a dict like dict(BLOCK_Q=128, BLOCK_KV=64, "
                                        f"num_warps=8, num_stages=3), got {type(config).__name__}")
                missing = [k for k in ("BLOCK_Q", "BLOCK_KV", "num_warps", "num_stages") if k not in config]
                if missing:
                    raise ExerciseError(f"{call} returned {config}: the key(s) {missing} are missing")
                try:
                    bq, bkv, warps, stages = (int(config[k]) for k in ("BLOCK_Q", "BLOCK_KV", "num_warps", "num_stages"))
                except (TypeError, ValueError):
                    raise ExerciseError(f"{call} returned {config}: the values should be integers") from None
                if bq not in BLOCKS or bkv not in BLOCKS:
                    raise ExerciseError(f"{call} returned {config}: BLOCK_Q and BLOCK_KV must be powers of two "
                                        "from 16 (the smallest tile tl.dot takes) to 256")
                if warps not in WARPS:
                    raise ExerciseError(f"{call} returned {config}: num_warps must be 4 or 8 (one or two "
                                        "warpgroups, what Hopper's wgmma instructions are issued by)")
                if stages not in STAGES:
                    raise ExerciseError(f"{call} returned {config}: num_stages must be 1 to 4")
                problem = _why_not(kernel, bq, bkv, head_dim, warps, stages, e)
                if problem:
                    raise ExerciseError(f"{call} returned {config}, which does not fit: {problem}.")
                assert configs.fits(kernel, triton_config(bq, bkv, warps, stages), configs.block_d(head_dim), e,
                                   arch=archs.REFERENCE)
                fitting = _fitting(kernel, head_dim, e)
                target = min(64 * 64, max(c[0] * c[1] for c in fitting))
                if bq * bkv < target:
                    example = max((c for c in fitting if c[0] * c[1] >= target),  # squarest, deepest pipeline
                                  key=lambda c: (-c[0] * c[1], -abs(c[0].bit_length() - c[1].bit_length()),
                                                 c[3], -c[2]))
                    raise ExerciseError(
                        f"{call} returned {config}: it fits, but its score tile has only {bq} x {bkv} = "
                        f"{bq * bkv} elements where {target} fit (for example BLOCK_Q={example[0]}, "
                        f"BLOCK_KV={example[1]}, num_warps={example[2]}, num_stages={example[3]}). Tiles this "
                        "small leave the tensor cores idle: on the H200, going from 16x16 to 64x64 tiles made "
                        "the bf16 forward 6x faster.")
                chosen[(kernel, head_dim, e)] = (bq, bkv, warps, stages)
    passed(f"{name} picks configurations that fit and are not wastefully small for 3 kernels, 6 head dims "
           "and 2- and 4-byte inputs")
    print("your choices for 16-bit inputs (BLOCK_Q x BLOCK_KV, warps, stages):")
    for kernel in KERNELS:
        print(f"  {kernel:9}" + "  ".join(f"D={hd}: {c[0]}x{c[1]} w{c[2]} s{c[3]}" for hd in (64, 128, 256)
                                          for c in [chosen[(kernel, hd, 2)]]))


# --- Exercise 2: two tile sizes, predicted from the compiled code -----------------------------------

#: The two configurations the chapter compares: the ladder's 16 x 16 and 64 x 64 tiles on 4 warps.
TILE_PAIR = ((16, 16, 4, 3), (64, 64, 4, 3))


def sass(kernel):
    """A compiled kernel's machine code (SASS), as the cuobjdump that ships with Triton prints it."""
    from ...measure.compiled import cuobjdump

    return cuobjdump(kernel.asm["cubin"], "-sass")


def loop_instructions(kernel):
    """The instructions of the key loop's body in a compiled attention kernel: of the loops in its
    SASS (a branch back to an earlier address), the shortest that holds a matrix instruction (HMMA,
    HGMMA) or an FFMA: the stage without masks, where most tile pairs are computed."""
    import re

    code = []
    for line in sass(kernel).splitlines():
        match = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*);", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2), match.group(3)))
    bodies = []
    for address, opcode, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = [op for a, op, _ in code if int(target.group(1), 16) <= a <= address]
            if any(op.startswith(("HMMA", "HGMMA", "FFMA")) for op in body):
                bodies.append(len(body))
    return min(bodies) if bodies else None


def compile_rows(path=None, name="my_attn_fwd", configs=TILE_PAIR, causal=True):
    """In a process whose flashattn compiles (``flashattn.measure.compiled.in_child``): the kernel
    ``name`` of the module file ``path`` (a chapter 05 ``my_attn_fwd``, as the chapter's
    solutions module holds it), or without ``path`` the package's forward, compiled for sm_90 in
    bf16 at head dim 128 for each ``(BLOCK_Q, BLOCK_KV, num_warps, num_stages)`` of ``configs``.
    One row per configuration: its tiles, ``loop`` (:func:`loop_instructions`), its matrix
    instructions (``shapes``, ``HMMA``, ``HGMMA``), registers, spilled bytes, shared memory."""
    import importlib.util

    from ...measure import compiled

    fn = None
    if path is not None:
        spec = importlib.util.spec_from_file_location("kernel_of_chapter_05", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, name)
    rows = []
    for block_q, block_kv, num_warps, num_stages in configs:
        constexprs = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_Q=block_q, BLOCK_KV=block_kv, IS_CAUSAL=causal)
        if fn is None:
            kernel = compiled.compile_kernel("fwd", "bf16", dict(constexprs, DOT_PRECISION="ieee"),
                                             num_warps=num_warps, num_stages=num_stages)
        else:
            tensors = dict(Q="bf16", K="bf16", V="bf16", O="bf16", LSE2="fp32")
            contiguous = {arg: 1 for arg in fn.arg_names if arg.startswith("stride_") and arg.endswith("d")}
            strides = [arg for arg in fn.arg_names if arg.startswith("stride_") and arg not in contiguous]
            kernel = compiled.compile_sm90(fn, tensors, dict(constexprs, **contiguous), floats=("qk_scale",),
                                           aligned=(*tensors, *strides), num_warps=num_warps, num_stages=num_stages)
        regs, spill, smem = compiled.resources(kernel)
        found = compiled.instructions(kernel)
        rows.append(dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, num_warps=num_warps, num_stages=num_stages,
                         loop=loop_instructions(kernel), shapes=found["shapes"], HMMA=found["HMMA"],
                         HGMMA=found["HGMMA"], regs=regs, spill=spill, smem=smem))
    return rows


def issue_ratio(small, large):
    """The issue model's ratio of times: warp-instructions per score, ``num_warps * loop /
    (BLOCK_Q * BLOCK_KV)``, of ``small`` over ``large``."""
    per_score = [r["num_warps"] * r["loop"] / (r["BLOCK_Q"] * r["BLOCK_KV"]) for r in (small, large)]
    return per_score[0] / per_score[1]


def time_forward(kernel, block_q, block_kv, num_warps, num_stages, n=4096, heads=32, causal=True):
    """Milliseconds of one forward on this GPU, bf16, head dim 128, batch 1, ``n`` tokens: the chapter
    05 kernel ``kernel`` launched as chapter 05 does, or the package's forward if ``kernel`` is None.
    The median of ``triton.testing.do_bench``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    config = dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, num_warps=num_warps, num_stages=num_stages)
    if kernel is None:
        from ...kernels.forward import attention_forward

        return triton.testing.do_bench(lambda: attention_forward(q, k, v, causal, 128 ** -0.5, config=config))
    o, lse2 = torch.empty_like(q), torch.empty(1, heads, n, device="cuda")
    grid = (triton.cdiv(n, block_q), heads, 1)

    def run():
        kernel[grid](q, k, v, o, lse2, *q.stride(), *k.stride(), *v.stride(), *o.stride(), heads, n, n,
                     128 ** -0.5 * 1.4426950408889634, HEAD_DIM=128, BLOCK_D=128, IS_CAUSAL=causal, **config,
                     enable_fp_fusion=True)  # as the package's launches: the two timed alike

    return triton.testing.do_bench(run)


def _ratio_variant(small, large, variant):
    """The ratio by a known mistake, to name it."""
    def per_score(r):
        warps = 1 if variant == "no warps" else r["num_warps"]
        tile = {"no tile": 1, "rows only": r["BLOCK_Q"], "keys only": r["BLOCK_KV"]}.get(
            variant, r["BLOCK_Q"] * r["BLOCK_KV"])
        work = (r["HMMA"] + r["HGMMA"]) if variant == "matrix instructions" else r["loop"]
        return warps * work / tile
    ratio = per_score(small) / per_score(large)
    return 1 / ratio if variant == "inverted" else ratio


RATIO_HINTS = {
    "inverted": "it is the large tiles' time over the small tiles': the ratio asked is t(small) / t(large), "
                "greater than 1 when the small tiles are slower",
    "no warps": "the warps are missing: every warp of a program runs the loop body, so a program issues "
                "num_warps x loop warp-instructions per tile pair",
    "no tile": "the tiles' sizes are missing: a loop iteration of BLOCK_Q x BLOCK_KV tiles computes that many "
               "scores, so a whole attention takes N / BLOCK_Q programs of N / BLOCK_KV iterations each",
    "rows only": "only BLOCK_Q counts here: each program also runs N / BLOCK_KV iterations, so the whole attention "
                 "takes (N / BLOCK_Q) x (N / BLOCK_KV) of them",
    "keys only": "only BLOCK_KV counts here: there are also N / BLOCK_Q programs, so the whole attention runs "
                 "(N / BLOCK_Q) x (N / BLOCK_KV) iterations",
    "matrix instructions": "it counts the matrix instructions only: the model counts every instruction the "
                           "loop body issues (`loop`), loads, exponentials and reductions included",
}


def _row(block_q, block_kv, warps, loop, hmma=0, hgmma=0):
    return dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, num_warps=warps, num_stages=3, loop=loop, HMMA=hmma,
                HGMMA=hgmma, shapes=[], regs=128, spill=0, smem=32768)


#: Pairs of compile-table rows the checker asks about: (small, large).
RATIO_CASES = [(_row(32, 64, 4, 330, hmma=96), _row(128, 128, 8, 900, hgmma=64)),
               (_row(16, 16, 4, 164, hmma=24), _row(64, 64, 4, 392, hgmma=24)),
               (_row(16, 16, 4, 150, hmma=24), _row(128, 64, 8, 370, hgmma=24)),
               (_row(32, 32, 4, 292, hmma=64), _row(64, 128, 8, 520, hgmma=48)),
               (_row(16, 32, 8, 210, hmma=40), _row(64, 32, 4, 300, hgmma=16))]


def check_tile_ratio(predict_ratio):
    """Chapter 09: ``predict_ratio(small, large)`` must give the ratio of the times of a whole
    attention with the configurations of the compile-table rows ``small`` and ``large``, by the
    issue model: time proportional to the warp-instructions all programs issue, num_warps x loop
    per iteration, (N / BLOCK_Q) x (N / BLOCK_KV) iterations."""
    name = getattr(predict_ratio, "__name__", "predict_ratio")
    for small, large in RATIO_CASES:
        where = (f"{name}(small, large) with small = {small['BLOCK_Q']} x {small['BLOCK_KV']} tiles on "
                 f"{small['num_warps']} warps, loop {small['loop']}, and large = {large['BLOCK_Q']} x "
                 f"{large['BLOCK_KV']} on {large['num_warps']} warps, loop {large['loop']}")
        got = _number(attempt(predict_ratio, dict(small), dict(large), name=name, forbid=("flashattn",)), where)
        want = issue_ratio(small, large)
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        for variant, hint in RATIO_HINTS.items():
            if math.isclose(got, _ratio_variant(small, large, variant), rel_tol=1e-6):
                raise ExerciseError(f"{where} returned {got:.3f}, expected {want:.3f}: {hint}.")
        raise ExerciseError(f"{where} returned {got:.3f}, expected {want:.3f}: per score, a configuration issues "
                            "num_warps x loop / (BLOCK_Q x BLOCK_KV) warp-instructions; the ratio is the small "
                            "tiles' over the large tiles'.")
    passed(f"{name} gives the issue model's ratio for {len(RATIO_CASES)} pairs of configurations")
