"""The decode kernels as an H100/H200 (sm_90) builds them: compiled on any machine, resources checked.

The interpreter ignores layouts, registers and shared memory. This test compiles the decode
configurations that ``configs.decode_config`` can hand out (``flashattn.measure.compiled.decode_launches``),
and the merge kernel, and fails if one does not compile, spills registers to local memory (under
the Triton releases of ``flashattn.gpu.defaults.TRITONS``; under a newer one a spill is shown) or
needs more shared memory than a block may have. ``python tools/compile_check.py --kernel decode_split``
prints the same table (``--all`` adds every candidate the decode benchmark times).

Like tests/test_compiled_sm90.py, the test runs this file as a child process that defines
flashattn's kernels for the compiler (``torch.cuda.is_available`` answers True there, and nothing
is launched); the child exits 0 when all is well and SKIP when this machine cannot compile for
CUDA at all.

A second child (``launches``) runs ``flashattn.decode`` as on a GPU, with Triton's driver replaced
by a stand-in that compiles for sm_90 and records each launch instead of running it
(``tools/decode_host_time.py``, which times decode's host work the same way). decode sends
the first launch of each kind through Triton's JIT and later ones straight to the compiled kernel
it returned; the test checks that those later launches are exactly what the JIT would launch
(same compiled kernel, grid and arguments), also for inputs that Triton compiles differently
(misaligned pointers, strides not divisible by 16, TF32).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SKIP = 77  # the child's exit status when this machine cannot compile for sm_90 at all
ROOT = Path(__file__).resolve().parent.parent

# (dtype, head dim, dot precision, query rows per tile): 16 rows is 4 query heads per KV head and
# one new token; 32 and 64 rows take more heads or tokens (float32 tiles stop at 32 rows,
# decode.max_block_r); IEEE float32 multiplies without tensor cores (its own small
# configuration), TF32 with them; decode never uses 3xTF32 (configs.decode_precision).
CASES = [("bf16", 128, "ieee", 16), ("fp16", 128, "ieee", 16), ("bf16", 64, "ieee", 16),
         ("bf16", 256, "ieee", 16), ("bf16", 128, "ieee", 32), ("bf16", 128, "ieee", 64),
         ("bf16", 256, "ieee", 64), ("fp32", 128, "ieee", 16), ("fp32", 256, "ieee", 32),
         ("fp32", 128, "tf32", 32), ("fp32", 256, "tf32", 16), ("fp32", 256, "tf32", 32)]
MERGES = [(128, 2), (128, 64), (256, 2), (256, 64)]  # (head dim, splits): MAX_SPLITS is 64
# The split kernel with every variant on (compiled.DECODE_ALL_VARIANTS: a paged cache of a
# left-padded batch, ALiBi, softcap, a window), on sm_90 for the cases that take the most registers, and on the older GPUs
# (sm_75 multiplies with fused multiply-adds and has no bfloat16: fp16 and fp32 there) with the
# configuration decode_config gives each. Page sizes 16 and 256: the gather's index arithmetic
# differs (a page holds one tile of 16 keys, or several tiles).
VARIANT_CASES = [("bf16", 128, "ieee", 16), ("bf16", 256, "ieee", 64), ("fp32", 256, "ieee", 32),
                 ("fp32", 256, "tf32", 32)]
ARCH_VARIANT_CASES = {75: [("fp16", 128, "ieee", 16), ("fp32", 128, "ieee", 32)],
                      80: [("bf16", 128, "ieee", 64), ("bf16", 256, "ieee", 64), ("fp32", 128, "tf32", 32)],
                      86: [("bf16", 128, "ieee", 16), ("bf16", 256, "ieee", 32)],
                      89: [("fp16", 128, "ieee", 64), ("bf16", 256, "ieee", 64)]}
# Except the left padding where it is known to spill: with all the rest on, its page offsets tip the
# final kernel at bf16, head dim 256, 64 rows into spilling 8 to 16 bytes on sm_80 and sm_89
# (Triton 3.6 and 3.9); those cases are compiled with every other variant on.
LEFTPAD_SPILLS = {(80, "bf16", 256, 64), (89, "bf16", 256, 64)}
# The plain kernel at head dim 256 on the GPUs whose blocks have 100 KB (sm_86, sm_89) or 163 KB
# (sm_80) of shared memory: one stage of 64-key K/V tiles fills most of it, so decode_config must
# count the query and score tiles too.
ARCH_PLAIN_CASES = {80: [("fp32", 256, "tf32", 32)], 86: [("bf16", 256, "ieee", 64), ("fp32", 256, "tf32", 32)],
                    89: [("fp32", 256, "tf32", 16)]}


def run_child(*args):
    import flashattn

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by flashattn on a CPU
    # the child imports the flashattn this process tests, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).parent.parent),
                                                      env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                            timeout=1200, env=env, cwd=ROOT)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "cannot compile")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_decode_configurations_compile_without_spills():
    run_child()


def test_direct_launches_are_the_jits():
    run_child("launches")


# --- The child ----------------------------------------------------------------------------------------

def check_decode(compiled):
    import itertools

    import torch

    from flashattn.gpu import archs
    from flashattn.kernels.decode import MAX_SPLITS, max_block_r

    assert max(splits for _, splits in MERGES) == MAX_SPLITS
    assert max_block_r(torch.float32) == 32 and max_block_r(torch.bfloat16) == 64
    launches = [(f"{dtype} D={d} {precision} {rows} rows", dtype, launch)
                for dtype, d, precision, rows in CASES
                for launch in compiled.decode_launches(dtype, d, precision, rows)]
    launches += [(f"D={d}, {splits} splits", "bf16", compiled.decode_merge_launch(d, splits))
                 for d, splits in MERGES]
    launches = [(label, dtype, launch, 90) for label, dtype, launch in launches]
    launches += [(f"sm_{capability} {dtype} D={d} {precision} {rows} rows", dtype, launch, capability)
                 for capability, cases in ARCH_PLAIN_CASES.items() for dtype, d, precision, rows in cases
                 for launch in compiled.decode_launches(dtype, d, precision, rows, arch=archs.ARCHS[capability])]
    for capability, cases in {90: VARIANT_CASES, **ARCH_VARIANT_CASES}.items():
        for (dtype, d, precision, rows), page_size in itertools.product(cases, (16, 256)):
            variants = dict(compiled.DECODE_ALL_VARIANTS, PAGE_SIZE=page_size)
            if (capability, dtype, d, rows) in LEFTPAD_SPILLS:
                variants = {k: v for k, v in variants.items() if k not in ("LEFTPAD", "LeftPad")}
            launches += [(f"sm_{capability} {dtype} D={d} {precision} {rows} rows, all variants, pages of {page_size}",
                          dtype, launch, capability)
                         for launch in compiled.decode_launches(dtype, d, precision, rows, variants=variants,
                                                                arch=archs.ARCHS[capability])]
    from flashattn.gpu.defaults import TRITONS

    release = ".".join(map(str, compiled.triton_release()))
    problems = []
    for label, dtype, (name, constexprs, options), capability in launches:
        arch = archs.ARCHS[capability]
        try:
            regs, spill, smem = compiled.resources(compiled.compile_kernel(
                name, dtype, constexprs, target=compiled.target(capability), **options))
        except Exception as error:  # report and go on: one bad configuration should not hide the others
            problems.append(f"{name} {label}: {type(error).__name__}: {str(error)[:1500]}")
            continue
        # a spill fails under the Triton releases the configurations were chosen with (defaults.TRITONS)
        bad = (spill != 0 and release in TRITONS) or smem > arch.smem_per_block
        print(f"{'FAIL' if bad else 'ok  '} {name:12} {label:26} {options} {regs} registers, "
              f"{spill} bytes spilled, {smem // 1024} KB shared")
        if bad:
            problems.append(f"{name} {label} {constexprs} {options}: {spill} bytes spilled, {smem} bytes "
                            f"of shared memory (at most {arch.smem_per_block})")
    return problems


def _child():
    import torch

    torch.cuda.is_available = lambda: True  # flashattn then defines its kernels for the compiler
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    try:
        from flashattn.measure import compiled
    except ImportError as error:
        print(f"no Triton CUDA compiler: {error}")
        sys.exit(SKIP)
    import flashattn

    assert flashattn.RUNTIME == "gpu", flashattn.describe()
    try:  # a decode kernel that compiles on an H200: if it fails here, the toolchain is missing
        name, constexprs, options = compiled.decode_merge_launch(64, 4)
        compiled.compile_kernel(name, "fp16", constexprs, **options)
    except Exception as error:
        print(f"cannot compile for sm_90 here: {type(error).__name__}: {str(error)[:200]}")
        sys.exit(SKIP)
    problems = check_decode(compiled)
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)


def _same(a, b):
    """Two recorded launches are the same: kernel, grid, and each argument (the caller's tensors
    themselves; fresh outputs by dtype, shape and strides; numbers by value and type)."""
    import torch

    (launcher_a, grid_a, args_a), (launcher_b, grid_b, args_b) = a, b
    if launcher_a is not launcher_b or grid_a != grid_b or len(args_a) != len(args_b):
        return False
    for x, y in zip(args_a, args_b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if (x.dtype, x.shape, x.stride(), x.data_ptr() % 16) != (y.dtype, y.shape, y.stride(), y.data_ptr() % 16):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _launches_child():
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    from decode_host_time import install

    try:
        stand_in = install()
    except ImportError as error:
        print(f"no Triton CUDA compiler: {error}")
        sys.exit(SKIP)
    import flashattn

    dec = sys.modules["flashattn.kernels.decode"]

    def misaligned(shape, dtype):  # a view 2 bytes past an aligned address
        return torch.randn(1 + torch.Size(shape).numel()).to(dtype)[1:].view(shape)

    def cache(b, h, n, d, dtype, layout="bhnd"):
        if layout == "bnhd":
            return torch.randn(b, n, h, d).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d).to(dtype)

    full = torch.tensor([4096, 1000, 0], dtype=torch.int32)
    bf16, fp32 = torch.bfloat16, torch.float32
    q, k, v = torch.randn(3, 8, 1, 64).to(bf16), cache(3, 2, 4096, 64, bf16), cache(3, 2, 4096, 64, bf16)
    q3, k3, v3 = torch.randn(3, 8, 3, 64), cache(3, 2, 100, 64, fp32), cache(3, 2, 100, 64, fp32)
    pages16, pages256 = torch.randn(3 * 256, 16, 2, 64).to(bf16), torch.randn(3 * 16, 256, 2, 64).to(bf16)
    table16 = torch.randperm(3 * 256).view(3, 256).int()
    table256 = torch.randperm(3 * 16).view(3, 16).int()
    cases = {  # name: (q, k_cache, v_cache, cache_seqlens, float32 matmul precision)
        "bf16, 16 splits": (q, k, v, full, "highest"),
        "bf16, 1 split": (q, k, v, torch.tensor([300, 5, 0], dtype=torch.int32), "highest"),
        "q misaligned": (misaligned((3, 8, 1, 64), bf16), k, v, full, "highest"),
        "caches (B, N, H, D)": (q, cache(3, 2, 4096, 64, bf16, "bnhd"), cache(3, 2, 4096, 64, bf16, "bnhd"),
                                full, "highest"),
        "k rows of 72": (q, cache(3, 2, 4096, 72, bf16)[..., :64], v, full, "highest"),
        "v rows of 72": (q, k, cache(3, 2, 4096, 72, bf16)[..., :64], full, "highest"),
        "lengths misaligned": (q, k, v, torch.tensor([9, 4096, 1000, 0], dtype=torch.int32)[1:], "highest"),
        "fp32 IEEE, 1 split": (q3, k3, v3, torch.tensor([100, 3, 50]), "highest"),
        "fp32 TF32, 1 split": (q3, k3, v3, torch.tensor([100, 3, 50]), "high"),
        "paged, pages of 16": (q, pages16, pages16, full, "highest"),
        "alibi": (q, k, v, full, "highest"),
        "paged, pages of 256, alibi": (q, pages256, pages256, full, "highest"),
    }
    # the arguments beyond the four tensors: the block table (its own pointer) and the slopes
    extra = {"paged, pages of 16": dict(block_table=table16),
             "alibi": dict(alibi_slopes=torch.rand(8)),
             "paged, pages of 256, alibi": dict(block_table=table256, alibi_slopes=torch.rand(3, 8))}
    # Cases that Triton compiles differently from another case with the same shapes (else they
    # would test nothing): decode's keys must tell them apart.
    differs_from = {"bf16, 1 split": "bf16, 16 splits", "q misaligned": "bf16, 16 splits", "k rows of 72": "bf16, 16 splits",
                    "v rows of 72": "bf16, 16 splits",
                    "lengths misaligned": "bf16, 16 splits", "fp32 TF32, 1 split": "fp32 IEEE, 1 split",
                    "paged, pages of 16": "bf16, 16 splits", "alibi": "bf16, 16 splits",
                    "paged, pages of 256, alibi": "paged, pages of 16"}
    problems = []
    runs = {name: [] for name in cases}
    jit_runs = {"split": 0, "merge": 0}
    for kernel, label in ((dec.decode_split, "split"), (dec.decode_merge, "merge")):
        def counting(*args, _run=kernel.run, _label=label, **kwargs):
            jit_runs[_label] += 1
            return _run(*args, **kwargs)
        kernel.run = counting
    for round in range(3):  # the cases interleaved: each call must find its own plan
        for name, (q, k, v, lengths, precision) in cases.items():
            torch.set_float32_matmul_precision(precision)
            before = dict(jit_runs)
            stand_in.log = []
            flashattn.decode(q, k, v, lengths, **extra.get(name, {}))
            runs[name].append(list(stand_in.log))
            if round > 0 and jit_runs != before:
                problems.append(f"{name}: call {round + 1} went through Triton's JIT again")
    torch.set_float32_matmul_precision("highest")
    for name, calls in runs.items():
        first = calls[0]
        print(f"{name:22} {len(first)} launches: " + ", ".join(f"{l.name} grid {g}" for l, g, _ in first))
        for later in calls[1:]:
            if len(later) != len(first) or not all(_same(a, b) for a, b in zip(first, later)):
                problems.append(f"{name}: a direct launch differs from the JIT's: {first} / {later}")
    kernel_of = {name: calls[0][0][0] for name, calls in runs.items()}
    for name, other in differs_from.items():
        if kernel_of[name] is kernel_of[other]:
            problems.append(f"{name}: launched the compiled kernel of {other}")
    if [len(calls[0]) for calls in runs.values()] != [2, 1, 2, 2, 2, 2, 2, 1, 1, 2, 2, 2]:
        problems.append("expected a split and a merge launch, or one launch for one split")
    # Every way of launching and of allocating that kernels.decode.HOST offers (the benchmark switches
    # them) launches the same kernels on the same arguments, with lse returned or not.
    for launch in dec.HOST_CHOICES["launch"]:
        for buffers in dec.HOST_CHOICES["buffers"]:
            dec.set_host(launch=launch, buffers=buffers)
            for name, (q, k, v, lengths, precision) in cases.items():
                for return_lse in (False, True):
                    torch.set_float32_matmul_precision(precision)
                    before = dict(jit_runs)
                    stand_in.log = []
                    flashattn.decode(q, k, v, lengths, return_lse=return_lse, **extra.get(name, {}))
                    if (jit_runs != before) != (launch == "jit"):
                        problems.append(f"{name}, {launch}/{buffers}: Triton's JIT "
                                        f"{'not ' if launch == 'jit' else ''}used")
                    first = runs[name][0]
                    if len(stand_in.log) != len(first) or not all(map(_same, first, stand_in.log)):
                        problems.append(f"{name}, {launch}/{buffers}, return_lse={return_lse}: a launch "
                                        f"differs from the JIT's: {first} / {stand_in.log}")
    # With a launch hook registered (a profiler's), the launcher way hands the hooks their calls
    from triton import knobs

    dec.set_host(launch="launcher", buffers="one")
    torch.set_float32_matmul_precision("highest")
    q, k, v, lengths, _ = cases["bf16, 16 splits"]
    hook = lambda metadata: None  # noqa: E731
    for registered in (False, True):
        if registered:
            knobs.runtime.launch_enter_hook.add(hook)
        stand_in.hooks = []
        flashattn.decode(q, k, v, lengths)
        knobs.runtime.launch_enter_hook.remove(hook)
        if len(stand_in.hooks) != 2 or any((h is None) == registered for h in stand_in.hooks):
            problems.append(f"hook registered: {registered}; the launches got {stand_in.hooks}")
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        flashattn.decode(q, k, v, full)
        problems.append("decode ran while a CUDA graph was being captured")
    except ValueError as error:
        if "CUDA graph" not in str(error):
            problems.append(f"decode under capture: {error}")
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    _launches_child() if sys.argv[1:] == ["launches"] else _child()
