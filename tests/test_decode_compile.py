"""The decode kernels as an H100/H200 (sm_90) builds them: compiled on any machine, resources checked.

The interpreter ignores layouts, registers and shared memory. This test compiles, in a child process
that believes it has a GPU (nothing is launched), the decode configurations that
``tuning.decode_config`` can hand out, and fails if one does not compile, spills registers to local
memory or needs more shared memory than a block may have. Run as a script it prints the table,
and with ``--all`` adds every candidate the decode benchmark times:

    python tests/test_decode_compile.py [--all]

Skipped where Triton cannot compile for CUDA.
"""
import os
import sys

from sm90_child import ROOT, SKIP, run_as_child

SMEM_LIMIT = 227 * 1024  # shared memory one block may use on an H100/H200


def test_decode_configurations_compile_without_spills():
    run_as_child(__file__)


def _setup():
    """Make flashattn define its kernels for the compiler (nothing is launched); exit SKIP where
    this machine has no Triton CUDA compiler."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as error:
        print(f"no Triton CUDA compiler: {error}")
        sys.exit(SKIP)


def compile_one(fn, pointers, constexprs, config):
    """Compile ``fn`` for sm_90 as it is launched on contiguous inputs; return (registers per
    thread, spilled bytes, shared memory bytes)."""
    import compile_check  # registers and spills of a cubin, read with cuobjdump
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride_") and name.endswith("d"):  # contiguous head dim
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
    regs, spill = compile_check.resources(compiled.asm["cubin"])
    return regs, spill, compiled.metadata.shared


TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def split_kernel(dtype, head_dim, block_r, final, precision, config):
    """Compile _decode_split as decode_forward launches it."""
    from flashattn import tuning
    from flashattn.decode import _decode_split

    elem = TYPES[str(dtype)]
    pointers = dict(Q=elem, K=elem, V=elem, LENS="i32", O=elem if final else "fp32", LSE="fp32")
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=tuning.block_d(head_dim), BLOCK_R=block_r,
                      BLOCK_KV=config["BLOCK_KV"], FINAL=final, DOT_PRECISION=precision)
    return compile_one(_decode_split, pointers, constexprs, config)


def merge_kernel(dtype, head_dim, block_s):
    from flashattn import tuning
    from flashattn.decode import _decode_merge

    pointers = dict(O_PART="fp32", LSE_PART="fp32", O=TYPES[str(dtype)], LSE="fp32")
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=tuning.block_d(head_dim), BLOCK_S=block_s)
    return compile_one(_decode_merge, pointers, constexprs, dict(num_warps=4, num_stages=1))


def _child(everything):
    _setup()
    import torch

    from flashattn import tuning
    from flashattn.decode import MAX_SPLITS

    try:
        merge_kernel(torch.float16, 64, 4)
    except Exception as error:
        print(f"cannot compile for sm_90 here: {type(error).__name__}: {str(error)[:200]}")
        sys.exit(SKIP)

    # (label, dtype, head dim, query rows, dot precision, config or None for decode_config's)
    cases = [("bf16 D=128, 4 heads x 1 token", torch.bfloat16, 128, 16, "ieee", None),
             ("fp16 D=128", torch.float16, 128, 16, "ieee", None),
             ("bf16 D=64", torch.bfloat16, 64, 16, "ieee", None),
             ("bf16 D=256", torch.bfloat16, 256, 16, "ieee", None),
             ("bf16 D=128, 32 rows", torch.bfloat16, 128, 32, "ieee", None),
             ("bf16 D=128, 64 rows", torch.bfloat16, 128, 64, "ieee", None),
             ("fp32 IEEE D=128", torch.float32, 128, 16, "ieee", None),
             ("fp32 IEEE D=256", torch.float32, 256, 16, "ieee", None),
             ("fp32 TF32 D=128", torch.float32, 128, 16, "tf32", None)]
    if everything:
        cases += [(f"bf16 D=128 candidate {c}", torch.bfloat16, 128, 16, "ieee", c)
                  for c in tuning.DECODE_CANDIDATES]
    failures = 0
    print(f"{'kernel':7} {'case':36} {'config':36} {'regs':>4} {'spill':>5} {'smem':>6}")

    def report(kernel, label, config, result):
        nonlocal failures
        try:
            regs, spill, smem = result()
        except Exception as error:  # report and go on: one bad config should not hide the others
            failures += 1
            print(f"{kernel:7} {label:36} {config:36} FAILED: {str(error).splitlines()[0][:200]}")
            return
        bad = spill > 0 or smem > SMEM_LIMIT
        failures += bad
        print(f"{kernel:7} {label:36} {config:36} {regs:4} {spill:5} {smem // 1024:5}K"
              + ("  <- spills or too much shared memory" if bad else ""), flush=True)

    for label, dtype, head_dim, block_r, precision, candidate in cases:
        config = tuning.decode_config(dtype, precision, block_r, tuning.block_d(head_dim), candidate)
        for final in (False, True) if candidate is None else (False,):
            name = "final" if final else "split"
            report(name, label, str(config), lambda: split_kernel(dtype, head_dim, block_r, final, precision, config))
    for head_dim in (128, 256):
        for block_s in (2, MAX_SPLITS):
            report("merge", f"D={head_dim}, {block_s} splits", "num_warps 4",
                   lambda: merge_kernel(torch.bfloat16, head_dim, block_s))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    _child("--all" in sys.argv)
