"""Choosing tile configurations on a GPU, checked on the CPU with a fake kernel and fake timings:
without FLASHATTN_AUTOTUNE nothing is timed (each kernel runs its default), with
FLASHATTN_AUTOTUNE=1 the choice is timed once and kept on disk for later processes, under a key
that separates GPUs, Triton versions, kernels, dtypes, head dims, masks and length buckets."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashattn
from flashattn import hopper
from flashattn.gpu import configs, launcher
from flashattn.ops import dispatch

PACKAGE_ROOT = str(Path(flashattn.__file__).resolve().parent.parent)

# A process that autotunes the forward kernel at two lengths and several keys. The tuner is fake: it
# records that it timed and "finds" the candidate at index FASTEST fastest. The kernel is fake too.
SCRIPT = r"""
import json, sys
import torch
from flashattn.gpu import configs, launcher

fastest, device_name = int(sys.argv[1]), sys.argv[2]
timed, launched = [], []

class FakeTuner:
    def __init__(self, configs):
        self.configs = configs
    def __getitem__(self, grid):
        def run(*args, **constexprs):
            timed.append(len(self.configs))
            self.best_config = self.configs[fastest]
        return run

class FakeKernel:
    cache_key = "0123456789abcdef-the-kernel's-source"
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launched.append(kwargs)

launcher._tuner = lambda name, kernel, bucket, configs: FakeTuner(configs)
torch.cuda.get_device_name = lambda *args: device_name
q = torch.empty(2, 2, dtype=torch.float16)
chosen = []
for seq_len, head_dim in ((1000, 64), (1024, 64), (5000, 64), (1000, 128)):
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, IS_CAUSAL=True, DOT_PRECISION="ieee")
    chosen.append(launcher._autotuned("fwd", FakeKernel(), None, (q,), constexprs, seq_len))
print(json.dumps(dict(chosen=chosen, timed=len(timed), launched=len(launched))))
"""


def run(tmp_path, fastest, device_name="Fake GPU"):
    env = {**os.environ, "FLASHATTN_CACHE_DIR": str(tmp_path), "FLASHATTN_AUTOTUNE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(fastest), device_name], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_autotuning_is_kept_on_disk_across_processes(tmp_path):
    candidates = [configs.as_dict(c) for c in configs.GPU_CONFIGS["fwd"]]
    first = run(tmp_path, fastest=2)
    # lengths 1000 and 1024 share a bucket: three keys timed (the tuner launches those), the fourth
    # call goes straight to the kernel with the choice made for its bucket
    assert first["timed"] == 3 and first["launched"] == 1
    assert first["chosen"] == [candidates[2]] * 4
    kept = json.loads((tmp_path / "autotune.json").read_text())
    assert len(kept) == 3 and all("Fake GPU" in key and "fwd" in key for key in kept)

    # a new process times nothing and runs what the first one chose, although its "timings" differ
    second = run(tmp_path, fastest=5)
    assert second["timed"] == 0 and second["launched"] == 4 and second["chosen"] == first["chosen"]

    # another GPU is another key
    other = run(tmp_path, fastest=5, device_name="Other GPU")
    assert other["timed"] == 3 and other["chosen"] == [candidates[5]] * 4


def test_a_stale_or_broken_cache_is_tuned_again(tmp_path):
    run(tmp_path, fastest=1)
    path = tmp_path / "autotune.json"
    entries = json.loads(path.read_text())
    entries = {key: dict(value, BLOCK_Q=12345) for key, value in entries.items()}  # no longer a candidate
    path.write_text(json.dumps(entries))
    assert run(tmp_path, fastest=3)["timed"] == 3
    path.write_text("{ not json")
    assert run(tmp_path, fastest=3)["timed"] == 3


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("", False), ("1", True)])
def test_autotuning_is_opt_in(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("FLASHATTN_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("FLASHATTN_AUTOTUNE", value)
    assert launcher.autotuning() == on


def test_without_autotuning_the_default_runs_untimed(monkeypatch):
    """The default path compiles and launches one configuration, the architecture's default, and
    remembers it; nothing is timed."""
    monkeypatch.setattr(launcher, "_tuner", lambda *args: pytest.fail("timed without FLASHATTN_AUTOTUNE=1"))
    monkeypatch.setattr(launcher, "_defaults", {})
    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    q = torch.empty(2, 2, dtype=torch.bfloat16)
    constexprs = dict(HEAD_DIM=128, BLOCK_D=128, IS_CAUSAL=True, DOT_PRECISION="ieee")
    for _ in range(2):
        ran = launcher._default("bwd_dkdv", FakeKernel(), None, (q,), constexprs)
    expected = configs.as_dict(configs.default_config("bwd_dkdv", torch.bfloat16, "ieee", 128))
    assert ran == expected and len(launched) == 2
    assert all({k: v for k, v in kw.items() if k in expected} == expected for kw in launched)


@pytest.mark.parametrize("name", sorted(configs.INTERPRETER_CONFIGS))
def test_each_kernels_tuner_is_keyed_on_arguments_it_takes(name, monkeypatch):
    """Triton's autotuner (>= 3.8) refuses a key naming what the kernel does not take; the Delta
    kernel takes neither IS_CAUSAL nor DOT_PRECISION. Built here for each real kernel, as
    FLASHATTN_AUTOTUNE=1 builds it at its first call."""
    import triton
    from flashattn.kernels import backward, forward
    kernel = {"fwd": forward.attn_fwd, "bwd_preprocess": backward.attn_bwd_preprocess,
              "bwd_dkdv": backward.attn_bwd_dkdv, "bwd_dq": backward.attn_bwd_dq}[name]
    monkeypatch.setattr(launcher, "_tuners", {})
    tuner = launcher._tuner(name, kernel, 128, [triton.Config(configs.INTERPRETER_CONFIGS[name])])
    assert set(tuner.keys) <= set(kernel.arg_names), tuner.keys
    assert {"HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION", "HEAD_DIM_V"} & set(kernel.arg_names) <= set(tuner.keys)
    assert "HEAD_DIM" in tuner.keys


@pytest.mark.parametrize("heads_q", [1, 2], ids=["one-head", "grouped"])
@pytest.mark.parametrize("head_dim, gluon", [(64, False), (128, True)])
def test_gluon_dkdv_only_where_it_was_measured_faster(monkeypatch, head_dim, gluon, heads_q):
    """Without TMA reduce-adds (Triton 3.6, 3.7.1: no fused backward) the backward calls the Gluon
    dK/dV kernel only at dispatch.GLUON_DKDV_HEAD_DIMS (head dim 128: faster than the Triton kernel
    there on an H200, slower at 64), grouped heads included. A fake Gluon module stands in on the
    CPU; dQ always comes from the Triton kernel."""
    assert dispatch.GLUON_DKDV_HEAD_DIMS == (128,)
    asked, calls = [], []

    class FakeGluon:
        @staticmethod
        def supports(q, k, v):
            return True

        @staticmethod
        def has_dq_reduce():
            return False

        @staticmethod
        def attention_backward_dkdv(q, k, v, *args, **mods):
            calls.append(q.shape[-1])
            return torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(hopper, "load", lambda name: asked.append(name) or FakeGluon)
    g = torch.Generator().manual_seed(0)
    q, o, do = (torch.randn(1, heads_q, 5, head_dim, generator=g) for _ in range(3))
    k, v = (torch.randn(1, 1, 5, head_dim, generator=g) for _ in range(2))
    lse2 = torch.randn(1, heads_q, 5, generator=g)
    dq, dk, dv = dispatch.attention_backward(q, k, v, o, lse2, do, False, head_dim ** -0.5)
    assert asked == ["backward"] and calls == ([head_dim] if gluon else [])
    assert dk.abs().max().item() == 0.0 if gluon else dk.abs().max().item() > 0.0
    assert dq.abs().max().item() > 0.0
