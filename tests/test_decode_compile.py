"""The decode kernels as an H100/H200 (sm_90) builds them: compiled on any machine, resources checked.

The interpreter ignores layouts, registers and shared memory. This test compiles the decode
configurations that ``tuning.decode_config`` can hand out (``flashattn.compiled.decode_launches``),
and the merge kernel, and fails if one does not compile, spills registers to local memory or needs
more shared memory than a block may have. ``python tools/compile_check.py --kernel decode_split``
prints the same table (``--all`` adds every candidate the decode benchmark times).

Like tests/test_compiled_sm90.py, the test runs this file as a child process that defines
flashattn's kernels for the compiler (``torch.cuda.is_available`` answers True there, and nothing
is launched); the child exits 0 when all is well and SKIP when this machine cannot compile for
CUDA at all.
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
# configuration), TF32 with them; decode never uses 3xTF32 (tuning.decode_precision).
CASES = [("bf16", 128, "ieee", 16), ("fp16", 128, "ieee", 16), ("bf16", 64, "ieee", 16),
         ("bf16", 256, "ieee", 16), ("bf16", 128, "ieee", 32), ("bf16", 128, "ieee", 64),
         ("bf16", 256, "ieee", 64), ("fp32", 128, "ieee", 16), ("fp32", 256, "ieee", 32),
         ("fp32", 128, "tf32", 32), ("fp32", 256, "tf32", 16), ("fp32", 256, "tf32", 32)]
MERGES = [(128, 2), (128, 64), (256, 2), (256, 64)]  # (head dim, splits): MAX_SPLITS is 64


def test_decode_configurations_compile_without_spills():
    import flashattn

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by flashattn on a CPU
    # the child imports the flashattn this process tests, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).parent.parent),
                                                      env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                            env=env, cwd=ROOT)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "cannot compile")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


# --- The child ----------------------------------------------------------------------------------------

def check_decode(compiled):
    import torch

    from flashattn.decode import MAX_SPLITS, max_block_r

    assert max(splits for _, splits in MERGES) == MAX_SPLITS
    assert max_block_r(torch.float32) == 32 and max_block_r(torch.bfloat16) == 64
    launches = [(f"{dtype} D={d} {precision} {rows} rows", dtype, launch)
                for dtype, d, precision, rows in CASES
                for launch in compiled.decode_launches(dtype, d, precision, rows)]
    launches += [(f"D={d}, {splits} splits", "bf16", compiled.decode_merge_launch(d, splits))
                 for d, splits in MERGES]
    problems = []
    for label, dtype, (name, constexprs, options) in launches:
        try:
            regs, spill, smem = compiled.resources(compiled.compile_kernel(name, dtype, constexprs, **options))
        except Exception as error:  # report and go on: one bad configuration should not hide the others
            problems.append(f"{name} {label}: {type(error).__name__}: {str(error)[:1500]}")
            continue
        bad = spill != 0 or smem > compiled.SMEM_PER_BLOCK
        print(f"{'FAIL' if bad else 'ok  '} {name:12} {label:26} {options} {regs} registers, "
              f"{spill} bytes spilled, {smem // 1024} KB shared")
        if bad:
            problems.append(f"{name} {label} {constexprs} {options}: {spill} bytes spilled, {smem} bytes "
                            f"of shared memory (at most {compiled.SMEM_PER_BLOCK})")
    return problems


def _child():
    import torch

    torch.cuda.is_available = lambda: True  # flashattn then defines its kernels for the compiler
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    try:
        from flashattn import compiled
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


if __name__ == "__main__":
    _child()
