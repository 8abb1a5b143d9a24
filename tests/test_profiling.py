"""flashattn.measure.profiling reads proton's tree (the JSON layout of proton's own examples: a root frame
with scopes and kernels as children, then a dict of devices) and refuses to record without a GPU."""
import pytest
import torch

from flashattn.measure import profiling


def frame(name, metrics=None, children=()):
    return {"frame": {"name": name, "type": "function"}, "metrics": metrics or {}, "children": list(children)}


def kernel(name, count, ns):
    return frame(name, {"count": count, "device_id": "0", "device_type": "CUDA", "time (ns)": ns})


PROFILE = {"setting": dict(profiling.REFERENCE, repeats=2), "proton": [
    frame("ROOT", {"count": 0, "time (ns)": 0}, [
        frame("forward", {"flops": 4.0e12}, [kernel("attn_fwd", 2, 9_000_000)]),
        frame("backward", {"flops": 1.0e13}, [
            kernel("attn_bwd_preprocess", 2, 300_000),
            kernel("attn_bwd_dkdv", 2, 18_000_000),
            frame("__proton_launch_metadata", {}, []),
            kernel("attn_bwd_dq", 2, 11_000_000)]),
        kernel("elementwise_kernel", 4, 100_000)]),
    {"CUDA": {"0": {"arch": "90", "num_sms": 132}}}]}


def test_kernel_rows_follow_the_scopes():
    rows = profiling.kernel_rows(PROFILE)
    assert [(r["scope"], r["kernel"], r["count"]) for r in rows] == [
        ("forward", "attn_fwd", 2), ("backward", "attn_bwd_preprocess", 2), ("backward", "attn_bwd_dkdv", 2),
        ("backward", "attn_bwd_dq", 2), (None, "elementwise_kernel", 4)]
    assert rows[2]["ms"] == 18.0 and rows[2]["flops"] == 1.0e13 and rows[-1]["flops"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_record_needs_a_gpu(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        profiling.record(tmp_path / "profile.json")


@pytest.mark.gpu
def test_record_a_small_profile(tmp_path):
    profile = profiling.record(tmp_path / "profile.json", dtype="bf16", heads=2, n=256, head_dim=64, repeats=2)
    rows = profiling.kernel_rows(profiling.read(tmp_path / "profile.json"))
    scopes = {r["scope"] for r in rows}
    assert {"forward", "backward"} <= scopes, rows
    assert all(r["ms"] > 0 and r["count"] >= 1 for r in rows)
    assert profile["setting"]["repeats"] == 2
