"""The Gluon forward for Hopper (flashattn.hopper), compiled for sm_90 on any machine.

Gluon has no interpreter, so on a machine without a GPU compiling is all this kernel gets. A child
process (which believes it has a GPU; nothing is launched) compiles every configuration the package
ships, for both 16-bit dtypes and both masking modes, and checks what the compiler made of it:
no spills, shared memory within the 227 KB an H100/H200 block may use, the warps split into
partitions with their own register budgets (setmaxnreg), asynchronous wgmma and TMA copies.
Skipped where Triton cannot compile Gluon for CUDA.
"""
import os
import re
import sys

from sm90_child import ROOT, SKIP, run_as_child

SMEM_LIMIT = 227 * 1024


def test_gluon_forward_compiles_for_sm90():
    run_as_child(__file__)


def test_the_interpreter_never_imports_gluon():
    """On the CPU the hook in attention_forward must leave the Gluon module alone."""
    import torch

    import flashattn
    if not flashattn.runtime.INTERPRET:
        return
    q = torch.randn(1, 1, 20, 64, dtype=torch.float16)
    flashattn.attention(q, q, q, is_causal=True)
    assert "flashattn.hopper" not in sys.modules


def _child():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
    try:
        import compile_hopper  # tools/compile_hopper.py
        hopper = compile_hopper._hopper()
    except ImportError as error:
        print(f"no Gluon compiler here: {error}")
        sys.exit(SKIP)
    import torch

    problems = []
    for head_dim in hopper.HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                label = f"D={head_dim} {dtype} causal={causal} {hopper.CONFIGS[head_dim]}"
                try:
                    compiled = compile_hopper.compile_forward(head_dim, dtype, causal)
                except Exception as error:
                    if head_dim == hopper.HEAD_DIMS[0] and dtype == torch.float16 and not causal \
                            and "ptxas" in str(error).lower():
                        print(f"cannot compile for sm_90 here: {str(error)[:200]}")
                        sys.exit(SKIP)
                    problems.append(f"{label}: {type(error).__name__}: {str(error)[:300]}")
                    continue
                r = compile_hopper.resources(compiled)
                ptx = compiled.asm["ptx"]
                if r["stack"]:
                    problems.append(f"{label}: {r['stack']} bytes of stack (spills)")
                if r["smem"] > SMEM_LIMIT:
                    problems.append(f"{label}: {r['smem']} bytes of shared memory")
                if str(hopper.CONSUMER_REGS.value) not in r["setmaxnreg"]:
                    problems.append(f"{label}: no setmaxnreg {hopper.CONSUMER_REGS.value}: {r['setmaxnreg']}")
                if not re.search(r"wgmma\.mma_async", ptx) or "cp.async.bulk.tensor" not in ptx:
                    problems.append(f"{label}: no wgmma or no TMA copy in the PTX")
                print(f"{label}: {r}")
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    _child()
