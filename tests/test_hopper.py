"""The Gluon kernels for Hopper (flashattn.hopper.forward, flashattn.hopper.backward) on an H100/H200,
against float64 under the rule.

A wrong mbarrier phase does not raise an error, it deadlocks the GPU. So the Gluon kernels never
run in the test process: flashattn.measure.gpu_checks runs each (dtype, head dim, causal) group in a child
process that is killed when it stops making progress, and each test here reads its case's verdict.
A case runs through flashattn.attention (the hooks in the forward and backward launchers, checked
to call the Gluon kernels), forward and, for most cases, the backward through it: fp16/bf16, head
dims 64 and 128, causal or not, N in {1, 17, 128, 1000, 4103}, N_q != N_kv, (B, N, H, D)-transposed
inputs, large magnitudes; and in groups of their own (``gpu_checks.MOD_SHAPES``) a softcap,
ALiBi, sliding windows, the bottom-right alignment, dropout and all of them with grouped heads. The
watchdog itself is tested without a GPU.
"""
import time

import pytest
import torch

from flashattn.measure import gpu_checks

GROUPS = [(dtype, d, causal) for dtype in gpu_checks.DTYPES for d in gpu_checks.HEAD_DIMS
          for causal in (False, True)]
CASES = [case for group in GROUPS for case in gpu_checks.gluon_cases(*group)]
MOD_GROUPS = [(dtype, d) for dtype in gpu_checks.DTYPES for d in gpu_checks.HEAD_DIMS]
MOD_CASES = [case for group in MOD_GROUPS for case in gpu_checks.gluon_mod_cases(*group)]


def _hopper_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(scope="module")
def verdicts():
    if not _hopper_gpu():
        pytest.skip("the Gluon kernels are for compute capability 9.x (H100/H200)")
    deadline = time.time() + 1800  # 12 groups of 12 to 31 cases, 4 at a time, compiling as they go

    def command(g):
        if len(g) == 2:  # the score modifications of one (dtype, head dim)
            return gpu_checks.command("gluon_mods", dtype=g[0], head_dim=g[1])
        dtype, d, causal = g
        return gpu_checks.command("gluon", dtype=dtype, head_dim=d, causal=int(causal))

    return gpu_checks.run_jobs([command(g) for g in GROUPS + MOD_GROUPS], 120, deadline, workers=4)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + MOD_CASES)
def test_gluon_kernels(verdicts, case):
    lines, status = verdicts
    said = "\n".join(line for line in lines if case in line or line.startswith("FAIL gluon"))
    assert status.get(case) == "ok", said or f"{case} did not run"


@pytest.mark.gpu
def test_layouts_tma_cannot_load_fall_back():
    """Strides TMA refuses, other dtypes and head dims go to the Triton kernels, and stay right."""
    if not _hopper_gpu():
        pytest.skip("the Gluon kernels are for compute capability 9.x (H100/H200)")
    from flashattn.hopper import forward as hopper
    from flashattn.testing.rule import compare_with_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(2, 3, 200, 68, device="cuda", generator=g, dtype=torch.float16)
    q, k, v = base[..., :64], base[..., 2:66], base[..., 4:68]  # rows 136 bytes apart
    assert not hopper.supports(q, k, v)
    checks = compare_with_reference(q, k, v, is_causal=True)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))
    for dtype, d in ((torch.float32, 64), (torch.float16, 96), (torch.bfloat16, 32)):
        t = torch.randn(1, 2, 50, d, device="cuda", dtype=dtype)
        assert not hopper.supports(t, t, t)
    t = torch.randn(1, 2, 50, 64, device="cuda", dtype=torch.float16)
    assert hopper.supports(t, t, t)
    odd = t.as_strided((1, 1, 50, 64), (3, 5, 64, 1))  # size-1 dims: their strides do not matter
    assert hopper.supports(odd, odd, odd)
    assert not hopper.tma_ok(t[:, :1].expand(1, 2, 50, 64))  # a repeated head: stride 0


@pytest.mark.gpu
def test_expanded_upstream_gradient():
    """dO from ``out.sum()`` is expanded (stride 0): the Gluon dK/dV copies it for TMA."""
    if not _hopper_gpu():
        pytest.skip("the Gluon kernels are for compute capability 9.x (H100/H200)")
    import flashattn

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    flashattn.attention(q, k, v, is_causal=True).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True).sum().backward()
    for ours, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert (ours.double() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_the_watchdog_reports_a_crash_and_a_hang_and_goes_on():
    """run_job (no GPU needed): a child that crashes or hangs in a case is reported with that case
    as FAIL or HANG, and started again after it, so that the cases after it still run."""
    import sys
    import textwrap

    child = textwrap.dedent("""
        import os, sys, time
        skip = sys.argv[sys.argv.index("--skip") + 1].split(",") if "--skip" in sys.argv else []
        for case in ("a", "crash", "hang", "d"):
            if case in skip:
                continue
            print("START", case, flush=True)
            if case == "crash":
                os._exit(3)
            if case == "hang":
                time.sleep(60)
            print("ok", case + ": fine", flush=True)
    """)
    lines, status = gpu_checks.run_job([sys.executable, "-c", child], idle_timeout=3,
                                       deadline=time.time() + 50)
    assert status == {"a": "ok", "crash": "FAIL", "hang": "HANG", "d": "ok"}, lines
    assert any(line.startswith("HANG hang") for line in lines), lines
