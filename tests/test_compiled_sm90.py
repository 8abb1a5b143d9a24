"""Kernels as a GPU builds them: compiled for an H100/H200 (sm_90) on any machine, no GPU needed.

Without a GPU the other tests run everything through Triton's interpreter, which *executes* the
kernels. A GPU *compiles* them, and that differs in ways the interpreter never shows:

- IEEE float32 accumulation. ``tl.dot(a, b, acc)`` in IEEE float32 is a chain of FMAs running
  through ``acc``, so a sum over N keys or queries is rounded N times in a row; ``tiles.dot_acc``
  keeps each tile's product a separate sum, and Triton's compiler would fuse a plain
  ``acc + tl.dot(a, b)`` back into ``tl.dot(a, b, acc)``. The test looks for the separate
  additions in the compiled IR (one per accumulator and loop stage); 16-bit inputs must keep the
  fused form.
- The Triton exercises (chapter 04's ladder included). The compiler refuses a stub's
  ``raise NotImplementedError()`` outright, and
  when the stub is a function the exercise's kernel calls, the error the launch reports only shows
  the calling line (the refusal is its cause). The test compiles the exercise kernels around the
  notebooks' solutions and stubs with the checkers' compile-time arguments, and checks that a
  stub's compile error becomes the checkers' "not implemented yet" while any other does not.

Each test runs this file as a child process that defines flashattn's kernels for the compiler
(``torch.cuda.is_available`` answers True there, and nothing is launched); the child exits 0 when
all is well and SKIP when this machine cannot compile for CUDA at all.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SKIP = 77  # the child's exit status when this machine cannot compile for sm_90 at all
ROOT = Path(__file__).resolve().parent.parent


def run_child(check):
    import flashattn

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by flashattn on a CPU
    # the child imports the flashattn this process tests, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).parent.parent),
                                                      env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, __file__, check], capture_output=True, text=True, timeout=300,
                            env=env, cwd=ROOT)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "cannot compile")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_ieee_float32_sums_each_tile_before_adding_it():
    run_child("accumulation")


def test_exercise_kernels_compile_for_sm90():
    run_child("exercises")


# --- The child ----------------------------------------------------------------------------------------

# kernel: (tile configuration, accumulator tile shape, separate additions expected in IEEE fp32)
ACCUMULATION = {
    "fwd": (dict(BLOCK_Q=32, BLOCK_KV=16), "32x64", 2),       # O, in 2 stages
    "bwd_dkdv": (dict(BLOCK_Q=16, BLOCK_KV=32), "32x64", 6),  # dK and dV, in 3 stages
    "bwd_dq": (dict(BLOCK_Q=32, BLOCK_KV=16), "32x64", 2),    # dQ, in 2 stages
}


def check_accumulation(compiled):
    def additions(name, dtype, precision, ir="ttir"):
        config, shape, _ = ACCUMULATION[name]
        kernel = compiled.compile_kernel(name, dtype, dict(config, HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True,
                                                           DOT_PRECISION=precision))
        return len(re.findall(rf"arith\.addf .*tensor<{shape}xf32", kernel.asm[ir]))

    problems = []
    for name, (_, _, expected) in ACCUMULATION.items():
        found = additions(name, "fp32", "ieee")
        if found != expected:
            problems.append(f"{name}, IEEE float32: {found} separate additions of the accumulator, "
                            f"expected {expected} (one per accumulator and loop stage)")
        split = additions(name, "fp32", "tf32x3", ir="ttgir")  # tiles.dot's three TF32 products
        if split != expected:
            problems.append(f"{name}, 3xTF32: {split} separate additions of the accumulator, "
                            f"expected {expected}: the accumulator was fused into the split's TF32 "
                            "products, so dot_acc must keep the sums apart for tf32x3 too")
        fused = additions(name, "fp16", "ieee")
        if fused:
            problems.append(f"{name}, float16: {fused} separate additions; the tensor-core path must "
                            "accumulate inside tl.dot")
    return problems


def check_exercises(compiled):
    import triton

    from flashattn.course import exercises as ex
    from flashattn.course.exercises.common import launch_error
    from flashattn.course.exercises.solutions import load

    def notebook(chapter, stub=None):
        (path,) = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
        return load(path, stub=stub)

    ch04, ch05, ch07, ch08 = notebook("04"), notebook("05"), notebook("07"), notebook("08")

    def fwd(inner, d, causal, dtype, block_q, block_kv):  # as run_fwd_inner launches it
        pointers = dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32")
        return ex.fwd_exercise_kernel, pointers, dict(INNER=inner, HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv,
                                                      IS_CAUSAL=causal), ("qk_scale",)

    def dq(inner, d, causal):  # as run_loop launches it
        pointers = {name: "fp32" for name in ("Q", "K", "V", "dO", "LSE", "Delta", "dQ")}
        return ex.dq_exercise_kernel, pointers, dict(INNER=inner, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                                                     BLOCK_Q=32, BLOCK_KV=16, IS_CAUSAL=causal), ("scale", "qk_scale")

    def dkdv(inner, d, causal, block_q=16, block_kv=32):  # as run_loop launches it
        pointers = {name: "fp32" for name in ("Q", "K", "V", "dO", "LSE", "Delta", "dK", "dV")}
        constexprs = dict(INNER=inner, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                          BLOCK_KV=block_kv, IS_CAUSAL=causal)
        return ex.dkdv_exercise_kernel, pointers, constexprs, ("scale", "qk_scale")

    def kernel(fn, outputs, dtype, d, causal, block_q, block_kv):  # as the checkers launch the whole kernels
        pointers = {name: dtype for name in ("Q", "K", "V", "dO", *outputs)}
        pointers.update(LSE2="fp32", Delta="fp32")
        return fn, pointers, dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q,
                                  BLOCK_KV=block_kv, IS_CAUSAL=causal), ("scale", "qk_scale")

    def delta(kernel, dtype, d, block_q):  # as check_delta_kernel launches it
        return kernel, dict(O=dtype, dO=dtype, Delta="fp32"), dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                                                                   BLOCK_Q=block_q), ()

    def row_lse(kernel, block_rows, block_cols):  # as check_row_lse_kernel launches it
        return kernel, dict(X="fp32", LSE="fp32"), dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), ()

    def ladder(kernel, tensors, constexprs, floats=()):  # chapter 04's ladder, float32 tensors
        return kernel, {name: "fp32" for name in tensors}, constexprs, floats

    # (what, expected outcome, name the checker uses, (kernel, pointers, constexprs, float args))
    cases = [
        ("causal_mask_kernel", "compiles", "causal_mask_kernel",
         ladder(ch04.causal_mask_kernel, "S", dict(BLOCK_Q=32, BLOCK_KV=16))),
        ("row_softmax_kernel, BLOCK=64", "compiles", "row_softmax_kernel",
         ladder(ch04.row_softmax_kernel, "XY", dict(BLOCK=64))),
        ("row_softmax_kernel, BLOCK=1", "compiles", "row_softmax_kernel",
         ladder(ch04.row_softmax_kernel, "XY", dict(BLOCK=1))),
        ("attention_tile_kernel, 16x16, D=16", "compiles", "attention_tile_kernel",
         ladder(ch04.attention_tile_kernel, "QKVO", dict(BLOCK_Q=16, BLOCK_KV=16, D=16), ("qk_scale",))),
        ("attention_tile_kernel, 32x64, D=32", "compiles", "attention_tile_kernel",
         ladder(ch04.attention_tile_kernel, "QKVO", dict(BLOCK_Q=32, BLOCK_KV=64, D=32), ("qk_scale",))),
        ("stream_kv_kernel, 32x16, D=16", "compiles", "stream_kv_kernel",
         ladder(ch04.stream_kv_kernel, "QKVO", dict(BLOCK_Q=32, BLOCK_KV=16, D=16), ("qk_scale",))),
        ("causal_mask_kernel stub", "not implemented", "causal_mask_kernel",
         ladder(notebook("04", stub="ch04-causal-mask").causal_mask_kernel, "S", dict(BLOCK_Q=32, BLOCK_KV=16))),
        ("fwd_inner, fp32, D=32, not causal, 32x16", "compiles", "fwd_inner", fwd(ch05.fwd_inner, 32, False, "fp32", 32, 16)),
        ("fwd_inner, fp32, D=16, causal, 16x32", "compiles", "fwd_inner", fwd(ch05.fwd_inner, 16, True, "fp32", 16, 32)),
        ("fwd_inner, fp16, D=32, causal, 32x16", "compiles", "fwd_inner", fwd(ch05.fwd_inner, 32, True, "fp16", 32, 16)),
        ("dq_inner, D=40 (padded to 64), causal", "compiles", "dq_inner", dq(ch07.dq_inner, 40, True)),
        ("dq_inner, D=16, not causal", "compiles", "dq_inner", dq(ch07.dq_inner, 16, False)),
        ("dkdv_inner, D=40 (padded to 64), causal", "compiles", "dkdv_inner", dkdv(ch07.dkdv_inner, 40, True)),
        ("dkdv_inner, D=16, not causal, 16x16", "compiles", "dkdv_inner", dkdv(ch07.dkdv_inner, 16, False, 16, 16)),
        ("delta_kernel, fp32, HEAD_DIM=40", "compiles", "delta_kernel", delta(ch07.delta_kernel, "fp32", 40, 16)),
        ("delta_kernel, fp16, HEAD_DIM=64", "compiles", "delta_kernel", delta(ch07.delta_kernel, "fp16", 64, 16)),
        ("my_attn_bwd_dq, fp32, D=24, causal, 32x16", "compiles", "my_attn_bwd_dq",
         kernel(ch07.my_attn_bwd_dq, ("dQ",), "fp32", 24, True, 32, 16)),
        ("my_attn_bwd_dq, fp16, D=64, not causal, 64x32", "compiles", "my_attn_bwd_dq",
         kernel(ch07.my_attn_bwd_dq, ("dQ",), "fp16", 64, False, 64, 32)),
        ("my_attn_bwd_dkdv, fp32, D=24, causal, 16x32", "compiles", "my_attn_bwd_dkdv",
         kernel(ch07.my_attn_bwd_dkdv, ("dK", "dV"), "fp32", 24, True, 16, 32)),
        ("my_attn_bwd_dkdv, fp16, D=64, causal, 32x64", "compiles", "my_attn_bwd_dkdv",
         kernel(ch07.my_attn_bwd_dkdv, ("dK", "dV"), "fp16", 64, True, 32, 64)),
        ("row_lse_kernel", "compiles", "row_lse_kernel", row_lse(ch08.row_lse_kernel, 4, 16)),
        # stubs, as the student versions have them: the learner's function is called by the
        # exercise's kernel, or is the kernel
        ("fwd_inner stub", "not implemented", "fwd_inner",
         fwd(notebook("05", stub="ch05-fwd-inner").fwd_inner, 32, True, "fp32", 32, 16)),
        ("dq_inner stub", "not implemented", "dq_inner", dq(notebook("07", stub="ch07-dq-inner").dq_inner, 32, True)),
        ("dkdv_inner stub", "not implemented", "dkdv_inner",
         dkdv(notebook("07", stub="ch07-dkdv-inner").dkdv_inner, 32, True)),
        ("delta_kernel stub", "not implemented", "delta_kernel",
         delta(notebook("07", stub="ch07-delta-kernel").delta_kernel, "fp32", 40, 16)),
        ("my_attn_bwd_dq stub", "not implemented", "my_attn_bwd_dq",
         kernel(notebook("07", stub="ch07-dq-kernel").my_attn_bwd_dq, ("dQ",), "fp32", 24, True, 32, 16)),
        ("my_attn_bwd_dkdv around a dkdv_inner stub", "not implemented", "dkdv_inner",
         kernel(notebook("07", stub="ch07-dkdv-inner").my_attn_bwd_dkdv, ("dK", "dV"), "fp32", 24, True, 16, 32)),
        ("row_lse_kernel stub", "not implemented", "row_lse_kernel",
         row_lse(notebook("08", stub="ch08-row-lse-kernel").row_lse_kernel, 4, 16)),
        # a compile error that is not a stub (tl.arange needs a power of two) must not be called one
        ("row_lse_kernel, BLOCK_COLS=24", "fails", "row_lse_kernel", row_lse(ch08.row_lse_kernel, 4, 24)),
    ]
    problems = []
    for what, expected, name, (kernel, pointers, constexprs, floats) in cases:
        try:
            compiled.compile_sm90(kernel, pointers, constexprs, floats)
            outcome, message = "compiles", ""
        except Exception as error:
            message = str(launch_error(error, name, constexprs))
            outcome = "not implemented" if "is not implemented yet" in message else "fails"
        print(f"{'ok  ' if outcome == expected else 'FAIL'} {what}: {outcome}")
        if outcome != expected:
            problems.append(f"{what}: {outcome} (expected: {expected}) {message[:1500]}")
    return problems


def _child(check):
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
    try:  # a package kernel that compiles on an H200: if it fails here, the toolchain is missing
        compiled.compile_kernel("bwd_preprocess", "fp16", dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_Q=64))
    except Exception as error:
        print(f"cannot compile for sm_90 here: {type(error).__name__}: {str(error)[:200]}")
        sys.exit(SKIP)
    problems = {"accumulation": check_accumulation, "exercises": check_exercises}[check](compiled)
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    _child(sys.argv[1])
