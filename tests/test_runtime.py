"""The runtime choice: interpreter without a GPU, whatever was imported first."""
import os
import subprocess
import sys

import pytest
import torch

import flashattn


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, tmp_path=None):
    """Run ``code`` in a fresh interpreter at the repository's root (``tmp_path`` on its path)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by our own import
    if tmp_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([ROOT, str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU")
def test_triton_imported_first_still_gets_the_interpreter(tmp_path):
    """A kernel defined before flashattn was imported is lost to the interpreter: the warning
    names it, and flashattn's own kernels run."""
    (tmp_path / "early_kernel.py").write_text(
        "import triton\n\n@triton.jit\ndef early_kernel(x):\n    pass\n")
    run_python("import warnings, torch, early_kernel\n"
               "with warnings.catch_warnings(record=True) as w:\n"
               "    warnings.simplefilter('always')\n"
               "    import flashattn\n"
               "assert flashattn.RUNTIME == 'interpreter'\n"
               "assert any('import flashattn first' in str(x.message) and 'early_kernel' in str(x.message)\n"
               "           for x in w), [str(x.message) for x in w]\n"
               "q = torch.randn(1, 1, 20, 16)\n"
               "torch.testing.assert_close(flashattn.attention(q, q, q),\n"
               "    torch.nn.functional.scaled_dot_product_attention(q, q, q))\n", tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU")
@pytest.mark.parametrize("first", ["import triton", "import torch._dynamo",
                                   "from transformers import LlamaForCausalLM"])
def test_triton_imported_first_without_kernels_is_quiet(first):
    """Libraries that import triton and define no kernel (torch._dynamo imports it, and
    transformers imports torch._dynamo) lose nothing when flashattn re-imports triton: no warning,
    of any kind (looking for kernels must touch nothing deprecated, e.g. torch.distributed.reduce_op)."""
    if first.startswith("from transformers"):
        pytest.importorskip("transformers",
                            reason='transformers is not installed (pip install "flashattn[transformers]")')
    result = run_python(f"import warnings, sys, torch\n{first}\n"
                        "assert 'triton' in sys.modules\n"
                        "with warnings.catch_warnings(record=True) as w:\n"
                        "    warnings.simplefilter('always')\n"
                        "    import flashattn\n"
                        "print([f'{x.category.__name__}: {x.message}' for x in w])\n"
                        "q = torch.randn(1, 1, 20, 16)\n"
                        "torch.testing.assert_close(flashattn.attention(q, q, q),\n"
                        "    torch.nn.functional.scaled_dot_product_attention(q, q, q))\n")
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_first_call_imports_no_compiler():
    # torch.library.custom_op would import torch._dynamo at the operators' first call (seconds):
    # flashattn.ops.autograd registers them without it.
    code = ("import sys, torch, flashattn\n"
            "q = torch.randn(1, 1, 20, 16, device=flashattn.DEVICE, requires_grad=True)\n"
            "out, lse = flashattn.attention(q, q, q, is_causal=True, return_lse=True)\n"
            "(out.sum() + lse.sum()).backward()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n")
    result = run_python(code)
    assert result.stdout.strip() == "[]", result.stdout


def test_describe_names_the_runtime():
    line = flashattn.describe()
    assert ("interpreter" in line) == (flashattn.RUNTIME == "interpreter")
    assert str(flashattn.DEVICE.type) in ("cpu", "cuda")


def test_launches_ask_for_fp_fusion_whatever_tritons_default():
    """The kernels were measured with multiplies and adds fused into fma, Triton's default up to
    3.9; Triton 3.10 turns it off (3.9 warns that it will). Every launch states it: the package's
    own ``run``, the direct decode launches and the Gluon kernels' options."""
    from flashattn.gpu import direct, launcher
    from flashattn.hopper import forward as hopper

    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    launcher.run(FakeKernel(), (1,), 1, 2, BLOCK=16)
    assert launched == [dict(BLOCK=16, enable_fp_fusion=True)]
    launcher.run(FakeKernel(), (1,), 1, enable_fp_fusion=False)  # asked otherwise: kept
    assert launched[-1] == dict(enable_fp_fusion=False)
    direct.launch({}, "key", FakeKernel(), (1,), (1,), lambda: dict(BLOCK=16))
    assert launched[-1] == dict(BLOCK=16, enable_fp_fusion=True)
    assert hopper.launch_options(hopper.tile_config(128, True))[1]["enable_fp_fusion"] is True
