"""The Gluon forward for Hopper (flashattn.hopper) on an H100/H200, against float64 under the rule.

A wrong mbarrier phase does not raise an error, it deadlocks the GPU. So the Gluon kernel never
runs in the test process: tools/hopper_check.py runs each (dtype, head dim, causal) group in a child
process that is killed when it stops making progress, and each test here reads its case's verdict.
A case runs through flashattn.attention (the hook in attention_forward, checked to call the Gluon
kernel), forward and, for most cases, the backward through it: fp16/bf16, head dims 64 and 128,
causal or not, N in {1, 17, 128, 1000, 4103}, N_q != N_kv, (B, N, H, D)-transposed inputs.
"""
import concurrent.futures
import os
import sys
import time

import pytest
import torch

from sm90_child import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import hopper_check  # noqa: E402  (tools/hopper_check.py)

pytestmark = pytest.mark.gpu
GROUPS = [(dtype, d, causal) for dtype in hopper_check.DTYPES for d in hopper_check.HEAD_DIMS
          for causal in (False, True)]
CASES = [case for group in GROUPS for case in hopper_check.gluon_cases(*group)]


def _hopper_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(scope="module")
def verdicts():
    if not _hopper_gpu():
        pytest.skip("the Gluon kernel is for compute capability 9.x (H100/H200)")
    deadline = time.time() + 900

    def group(g):
        dtype, d, causal = g
        return hopper_check.run_job("gluon", ["--dtype", dtype, "--head-dim", str(d),
                                              "--causal", str(int(causal))], 120, deadline)

    lines, status = [], {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for group_lines, group_status in pool.map(group, GROUPS):
            lines += group_lines
            status.update(group_status)
    return lines, status


@pytest.mark.parametrize("case", CASES)
def test_gluon_forward(verdicts, case):
    lines, status = verdicts
    said = "\n".join(line for line in lines if case in line or line.startswith("FAIL gluon"))
    assert status.get(case) == "ok", said or f"{case} did not run"


def test_layouts_tma_cannot_load_fall_back():
    """Strides TMA refuses, other dtypes and head dims go to the Triton kernel, and stay right."""
    if not _hopper_gpu():
        pytest.skip("the Gluon kernel is for compute capability 9.x (H100/H200)")
    from flashattn import hopper
    from flashattn.testing import compare_with_reference

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
