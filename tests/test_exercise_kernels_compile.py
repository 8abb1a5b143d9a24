"""The Triton exercises as a GPU builds them: compiled for an H100/H200 (sm_90), on any machine.

Without a GPU the other tests run the exercises through Triton's interpreter, which *executes* a
learner's @triton.jit function. A GPU *compiles* it, and that differs in ways the interpreter never
shows: the compiler refuses a stub's ``raise NotImplementedError()`` outright, and when the stub is
a function the exercise's kernel calls, the error the launch reports only shows the calling line
(the refusal is its cause). So this test compiles, in a child process that believes it has a GPU
(torch.cuda.is_available patched, no TRITON_INTERPRET; nothing is launched), the exercise kernels
of flashattn.exercises around the tests' reference solutions, with the checkers' compile-time
arguments, and checks that a stub's compile error becomes the checkers' "not implemented yet"
while any other compile error does not. Skipped where Triton cannot compile for CUDA.
"""
import os
import sys

from sm90_child import ROOT, SKIP, run_as_child


def test_exercise_kernels_compile_for_sm90():
    run_as_child(__file__)


def _child():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import torch

    torch.cuda.is_available = lambda: True  # flashattn then defines its kernels for the compiler
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        print(f"no Triton CUDA compiler: {error}")
        sys.exit(SKIP)

    import flashattn
    from flashattn import backward
    from flashattn import exercises as ex

    assert flashattn.RUNTIME == "gpu", flashattn.describe()
    import test_exercises_ch03_04 as ch04
    import test_exercises_ch05_07 as ch0607

    target = GPUTarget("cuda", 90, 32)

    def compile_sm90(fn, pointers, constexprs, floats=()):
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers
                     else "fp32" if name in floats else "i32" for name in fn.arg_names}
        return triton.compile(ASTSource(fn, signature, constexprs), target=target)

    try:  # a package kernel that compiles on an H200: if it fails here, the toolchain is missing
        compile_sm90(backward._attn_bwd_preprocess, dict(O="fp16", dO="fp16", Delta="fp32"),
                     dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_Q=64))
    except Exception as error:
        print(f"cannot compile for sm_90 here: {type(error).__name__}: {str(error)[:200]}")
        sys.exit(SKIP)

    def fwd(inner, d, causal, dtype, block_q, block_kv):  # as run_fwd_inner launches it
        pointers = dict(Q=dtype, K=dtype, V=dtype, O=dtype, LSE="fp32")
        return ex.fwd_exercise_kernel, pointers, dict(INNER=inner, HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_KV=block_kv,
                                                      IS_CAUSAL=causal), ("qk_scale",)

    def dq(inner, d, causal):  # as run_dq_inner launches it
        pointers = {name: "fp32" for name in ("Q", "K", "V", "dO", "LSE", "Delta", "dQ")}
        return ex.dq_exercise_kernel, pointers, dict(INNER=inner, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                                                     BLOCK_Q=32, BLOCK_KV=16, IS_CAUSAL=causal), ("scale", "qk_scale")

    def delta(kernel, dtype, d, block_rows):  # as check_delta_kernel launches it
        return kernel, dict(O=dtype, dO=dtype, Delta="fp32"), dict(HEAD_DIM=d, BLOCK_ROWS=block_rows,
                                                                   BLOCK_D=max(16, triton.next_power_of_2(d))), ()

    def row_lse(kernel, block_rows, block_cols):  # as check_row_lse_kernel launches it
        return kernel, dict(X="fp32", LSE="fp32"), dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols), ()

    # (what, expected outcome, name the checker uses, (kernel, pointers, constexprs, float args))
    cases = [
        ("fwd_inner, fp32, D=32, not causal, 32x16", "compiles", "fwd_inner", fwd(ch04.fwd_inner, 32, False, "fp32", 32, 16)),
        ("fwd_inner, fp32, D=16, causal, 16x32", "compiles", "fwd_inner", fwd(ch04.fwd_inner, 16, True, "fp32", 16, 32)),
        ("fwd_inner, fp16, D=32, causal, 32x16", "compiles", "fwd_inner", fwd(ch04.fwd_inner, 32, True, "fp16", 32, 16)),
        ("dq_inner, D=40 (padded to 64), causal", "compiles", "dq_inner", dq(ch0607.dq_inner, 40, True)),
        ("dq_inner, D=16, not causal", "compiles", "dq_inner", dq(ch0607.dq_inner, 16, False)),
        ("delta_kernel, fp32, HEAD_DIM=40", "compiles", "delta_kernel", delta(ch0607.delta_kernel, "fp32", 40, 16)),
        ("delta_kernel, fp16, HEAD_DIM=64", "compiles", "delta_kernel", delta(ch0607.delta_kernel, "fp16", 64, 16)),
        ("row_lse_kernel", "compiles", "row_lse_kernel", row_lse(ch0607.row_lse_kernel, 4, 16)),
        # stubs: the learner's function is called by the exercise's kernel, or is the kernel
        ("fwd_inner stub", "not implemented", "fwd_inner", fwd(ch04.fwd_inner_stub, 32, True, "fp32", 32, 16)),
        ("dq_inner stub", "not implemented", "dq_inner", dq(ch0607.dq_stub, 32, True)),
        ("delta_kernel stub", "not implemented", "delta_kernel", delta(ch0607.delta_stub, "fp32", 40, 16)),
        ("row_lse_kernel stub", "not implemented", "row_lse_kernel", row_lse(ch0607.row_lse_stub, 4, 16)),
        # a compile error that is not a stub (tl.arange needs a power of two) must not be called one
        ("row_lse_kernel, BLOCK_COLS=24", "fails", "row_lse_kernel", row_lse(ch0607.row_lse_kernel, 4, 24)),
    ]
    failures = 0
    for what, expected, name, (kernel, pointers, constexprs, floats) in cases:
        try:
            compile_sm90(kernel, pointers, constexprs, floats)
            outcome, message = "compiles", ""
        except Exception as error:
            message = str(ex._launch_error(error, name, constexprs))
            outcome = "not implemented" if "is not implemented yet" in message else "fails"
        ok = outcome == expected
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {outcome}" + ("" if ok else f" (expected: {expected}) {message[:1500]}"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    _child()
