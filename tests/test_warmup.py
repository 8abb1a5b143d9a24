"""flashattn.ops.warmup's decisions, on any machine: when it starts compiling the backward's kernels,
and that flashattn.gpu.launcher's deferred launches compile without launching. (On a GPU, tests/test_gpu.py checks
in a fresh process that the backward then compiles nothing.)"""
import pytest
import torch

import flashattn
from flashattn import hopper
from flashattn.gpu import launcher
from flashattn.ops import warmup

import triton  # noqa: E402  (after flashattn, which chooses Triton's mode)


@pytest.fixture
def submitted(monkeypatch):
    """The compiles warmup.start hands to its threads (their arguments), recorded instead of run, as
    on a GPU."""
    calls = []

    def submit(fn, *args):
        assert fn is warmup._compile_backward
        calls.append(args)
        return "future"
    monkeypatch.setattr(warmup, "INTERPRET", False)
    monkeypatch.setattr(warmup, "_started", {})
    monkeypatch.setattr(warmup._pool, "submit", submit)
    monkeypatch.setattr(warmup, "_prepare_triton", lambda: None)  # (builds a CUDA module)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv("FLASHATTN_AUTOTUNE", raising=False)
    return calls


def start(q, k, v, is_causal=True, window_size=(-1, -1)):
    warmup.start(q, k, v, is_causal, 0.125, window_size, None, torch.float32)


def qkv(dtype=torch.float16, heads_kv=2, requires_grad=True):
    q = torch.zeros(1, 2, 8, 16, dtype=dtype, requires_grad=requires_grad)
    k, v = (torch.zeros(1, heads_kv, 8, 16, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


def test_once_per_setting(submitted):
    q, k, v = qkv()
    for _ in range(3):
        start(q, k, v)
    assert len(submitted) == 1
    start(q, k, v, is_causal=False)               # another masking
    start(*qkv(dtype=torch.bfloat16))              # another dtype
    start(*qkv(heads_kv=1))                        # grouped heads
    start(q, k, v, window_size=(4, 0))             # a window
    assert len(submitted) == 5
    assert not any(t.requires_grad for args in submitted for t in args[:3])  # detached copies


def test_not_without_a_gradient_autotuning_or_a_graph_capture(submitted, monkeypatch):
    start(*qkv(requires_grad=False))
    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "1")  # autotuning times the kernels at the backward
    start(*qkv())
    monkeypatch.delenv("FLASHATTN_AUTOTUNE")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    start(*qkv())
    assert submitted == []


def test_not_on_the_interpreter(submitted, monkeypatch):
    monkeypatch.setattr(warmup, "INTERPRET", True)
    start(*qkv())
    assert submitted == []


class FakeKernel:
    """A kernel that records whether it was launched, or compiled and loaded only."""

    def __init__(self):
        self.events = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.events.append("launched")

    def warmup(self, *args, grid, **kwargs):
        self.events.append("compiled")
        return self

    def _init_handles(self):
        self.events.append("loaded")


def test_deferred_launches_compile_and_load_without_launching():
    kernel = FakeKernel()
    launcher.run(kernel, (1,), 1, BLOCK=16)
    with launcher.defer_compiles() as jobs:
        launcher.run(kernel, (1,), 1, BLOCK=16)
    assert kernel.events == ["launched"] and len(jobs) == 1  # recorded, not run
    launcher.compile_job(jobs[0])
    launcher.run(kernel, (1,), 1, BLOCK=16)
    assert kernel.events == ["launched", "compiled", "loaded", "launched"]


def test_a_deferred_default_launch_chooses_its_configuration_where_it_compiles(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRET", False)
    monkeypatch.setattr(launcher, "_defaults", {})
    monkeypatch.setattr(launcher, "default_config", lambda *args: triton.Config(dict(BLOCK=16), num_warps=4,
                                                                                num_stages=2))
    monkeypatch.setattr(launcher, "ranked", lambda *args: [])
    kernel = FakeKernel()
    with launcher.defer_compiles() as jobs:
        assert launcher.launch("fwd", kernel, (1,), (torch.zeros(4),), {}, 4) is None
    assert kernel.events == [] and launcher._defaults == {}
    launcher.compile_job(jobs[0])
    assert kernel.events == ["compiled", "loaded"]
    assert list(launcher._defaults.values()) == [dict(BLOCK=16, num_warps=4, num_stages=2)]


def test_wait_leaves_a_failed_compile_to_the_backward(monkeypatch):
    import concurrent.futures

    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("no such kernel"))
    collected = concurrent.futures.Future()  # a setting whose kernels were collected, one failed
    collected.set_result([failed])
    monkeypatch.setattr(warmup, "_started", {"setting": failed, "another": collected})
    warmup.wait()  # returns: the backward's own launch will raise with its own message


def test_gluon_modules_import_one_thread_at_a_time(monkeypatch):
    """The warm-up's thread imports flashattn.hopper.backward while the forward imports
    flashattn.hopper.forward: two threads importing Triton's Gluon modules at once met Python's import
    deadlock error on a GPU."""
    import threading
    import time

    monkeypatch.setattr(hopper, "INTERPRET", False)
    monkeypatch.delenv("FLASHATTN_GLUON", raising=False)
    inside, most = [0], [0]

    def import_module(name):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        inside[0] -= 1
        return name
    monkeypatch.setattr(hopper.importlib, "import_module", import_module)
    threads = [threading.Thread(target=hopper.load, args=(name,)) for name in ("forward", "backward")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_triton_is_prepared_three_jobs_side_by_side_and_failures_are_left_to_the_launch(monkeypatch):
    """The hash of Triton's files, the driver's C module and torch's lazy import run at the same
    time (each waits at a barrier the three must reach), and one that fails does not raise here."""
    import threading

    barrier, done = threading.Barrier(3, timeout=10), []

    def job(name, fails=False):
        def run():
            barrier.wait()
            done.append(name)
            if fails:
                raise RuntimeError(f"{name} failed")
        return run
    monkeypatch.setattr(triton.runtime.cache, "triton_key", job("hash"))
    monkeypatch.setattr(warmup, "_import_symbolic_shapes", job("import", fails=True))
    monkeypatch.setattr(warmup, "_load_driver", job("driver", fails=True))
    warmup._prepare_triton()
    assert sorted(done) == ["driver", "hash", "import"]


def test_a_deterministic_call_warms_its_own_backward(submitted):
    """``deterministic=True`` (or torch's deterministic algorithms) is a setting of its own, handed
    to the compile: its backward's kernels differ from the default's (no fused Gluon backward)."""
    q, k, v = qkv()
    start(q, k, v)
    warmup.start(q, k, v, True, 0.125, (-1, -1), None, torch.float32, True)
    assert [args[-1] for args in submitted] == [False, True]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        start(q, k, v)  # the same setting as the deterministic call's
    finally:
        torch.use_deterministic_algorithms(before)
    assert len(submitted) == 2


def test_flashattn_attention_hands_the_warm_up_its_deterministic(submitted):
    q, k, v = qkv(dtype=torch.float32)
    flashattn.attention(q, k, v, is_causal=True, deterministic=True)
    assert [args[-1] for args in submitted] == [True]
