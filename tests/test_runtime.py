"""The runtime choice: interpreter without a GPU, whatever was imported first."""
import os
import subprocess
import sys

import pytest
import torch

import flashattn


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU")
def test_triton_imported_first_still_gets_the_interpreter():
    code = ("import warnings, triton, torch\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import flashattn\n"
            "assert flashattn.RUNTIME == 'interpreter'\n"
            "assert any('import flashattn first' in str(x.message) for x in w)\n"
            "q = torch.randn(1, 1, 20, 16)\n"
            "torch.testing.assert_close(flashattn.attention(q, q, q),\n"
            "    torch.nn.functional.scaled_dot_product_attention(q, q, q))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by our own import
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]


def test_first_call_imports_no_compiler():
    # torch.library.custom_op would import torch._dynamo at the operators' first call (seconds):
    # flashattn.ops.autograd registers them without it.
    code = ("import sys, torch, flashattn\n"
            "q = torch.randn(1, 1, 20, 16, device=flashattn.DEVICE, requires_grad=True)\n"
            "out, lse = flashattn.attention(q, q, q, is_causal=True, return_lse=True)\n"
            "(out.sum() + lse.sum()).backward()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_describe_names_the_runtime():
    line = flashattn.describe()
    assert ("interpreter" in line) == (flashattn.RUNTIME == "interpreter")
    assert str(flashattn.DEVICE.type) in ("cpu", "cuda")
