"""The GPUs learners have: every configuration the package runs without timing compiles for sm_75
(T4), sm_80 (A100), sm_86 (RTX 30, A10), sm_89 (L4, RTX 40) and sm_90 (H100, H200), without
spilling and within the shared memory the architecture gives a block. No GPU is needed: Triton
compiles for any target.

The compiling is ``tools/compile_check.py``'s (run in a child process that believes it has a GPU;
nothing is launched): the defaults of ``flashattn/gpu/defaults.py``, one compile per distinct kernel,
dtype and dot precision, head-dim class and configuration. The other tests here check, on the CPU,
that the table covers every architecture and that the decisions around it (the rules against each
architecture's limits, bfloat16 before sm_80) are the ones the table was built with.
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import flashattn  # before triton: on a CPU it picks the interpreter
import triton
from flashattn.gpu import archs, runtime, configs, defaults
from flashattn.measure import compiled
from flashattn.gpu.defaults import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_default_compiles_for_every_architecture():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(flashattn.__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DISABLE_LINE_INFO", "1")  # registers and spills are the same, ptxas is faster
    jobs = os.environ.get("COMPILE_CHECK_JOBS", str(min(4, os.cpu_count() or 1)))
    result = subprocess.run([sys.executable, "tools/compile_check.py", "--jobs", jobs], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)
    if "cannot compile" in result.stdout and result.returncode == 77:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    summary = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else []
    print("\n".join(summary))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_the_table_covers_every_architecture_kernel_dtype_and_head_dim():
    assert sorted(DEFAULTS) == sorted(archs.ARCHS) == [75, 80, 86, 89, 90]
    for capability, arch in archs.ARCHS.items():
        missing = [key for key in compiled.table_keys(arch)
                   if key[3] not in DEFAULTS[capability].get(key[:3], {})]
        assert not missing, (f"sm_{capability}: no default for {missing[:5]} "
                             "(run tools/compile_check.py --write-defaults)")


@pytest.mark.parametrize("capability", sorted(archs.ARCHS))
def test_defaults_obey_the_architecture(capability):
    """Every entry keeps the dK/dV kernel's divisibility and, by the rules' own count, the
    architecture's shared memory; on sm_90 the measured winners are used wherever they compiled
    cleanly."""
    arch = archs.ARCHS[capability]
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for (name, dtype, precision), by_dim in DEFAULTS[capability].items():
        for block_d, spec in by_dim.items():
            if spec is None:  # no tile fits: refused (test_what_no_tile_fits_is_refused_by_name)
                continue
            bq, bkv, warps, stages = spec
            config = configs.default_config(name, dtypes[dtype], precision, block_d, arch)
            assert (config.kwargs.get("BLOCK_Q"), config.kwargs.get("BLOCK_KV", 0), config.num_warps,
                    config.num_stages) == (bq, bkv, warps, stages)
            if name == "bwd_preprocess":
                continue
            roomy = archs.Arch(capability, arch.gpus, arch.smem_per_block, arch.regs_per_sm,
                              tuple((kind, 1e9) for kind, _ in arch.register_budget))
            assert configs.fits(name, config, block_d, dtypes[dtype].itemsize, precision, roomy), \
                (capability, name, dtype, precision, block_d, config)


def test_rules_read_the_architecture():
    """The same tile is judged by each GPU's own limits: a 128 x 64 forward tile in 3 stages at head
    dim 128 (128 KB of shared memory by the rule) fits an A100 or H100, not an L4 or a T4."""
    config = triton.Config({"BLOCK_Q": 128, "BLOCK_KV": 64}, num_warps=8, num_stages=3)
    fits = {c: configs.fits("fwd", config, 128, 2, "ieee", arch) for c, arch in archs.ARCHS.items()}
    assert fits == {75: False, 80: True, 86: False, 89: False, 90: True}
    # on the CPU the rules are the reference GPU's
    if flashattn.INTERPRET:
        assert archs.current() is archs.REFERENCE
        assert configs.fits("fwd", config, 128, 2) == configs.fits("fwd", config, 128, 2, arch=archs.ARCHS[90])


def test_a_device_is_read_from_its_properties(monkeypatch):
    class Props:  # what torch.cuda.get_device_properties reports for an L4
        name, major, minor = "NVIDIA L4", 8, 9
        shared_memory_per_block_optin, regs_per_multiprocessor = 101376, 65536

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    archs._device.cache_clear()
    try:
        arch = archs._device(0)
        assert (arch.capability, arch.smem_per_block, arch.tensor_cores) == (89, 101376, True)
        assert arch.register_budget == archs.ARCHS[89].register_budget
        assert archs.arch_of((8, 7)) is archs.ARCHS[86] and archs.arch_of((10, 0)) is archs.ARCHS[90]
        with pytest.raises(RuntimeError, match="older than the oldest"):
            archs.arch_of((7, 0))
    finally:
        archs._device.cache_clear()


def test_bfloat16_before_sm80_runs_in_float32():
    """A T4 (sm_75) has no bfloat16 arithmetic and Triton no tensor-core path there: bfloat16 inputs
    are upcast and computed like float32, which on sm_75 means IEEE products (no TF32 either)."""
    assert runtime.bf16_in_float32(False, (7, 5))
    assert not runtime.bf16_in_float32(False, (8, 0)) and not runtime.bf16_in_float32(False, (9, 0))
    assert runtime.bf16_in_float32(True)  # the interpreter, whatever the GPU
    t4 = archs.ARCHS[75]
    assert compiled.dtype_paths(t4) == [("fp16", "ieee"), ("fp32", "ieee")]
    for dtype in (torch.float16, torch.float32):
        for precision in ("ieee", "tf32", "tf32x3"):
            assert configs.candidates("fwd", dtype, precision, t4) is configs.FMA_CONFIGS["fwd"]
    assert configs.dot_kind(2, "ieee", archs.ARCHS[80]) == "mma"
    assert configs.dot_kind(4, "tf32x3", archs.ARCHS[80]) == "tf32x3"
    assert configs.dot_kind(2, "ieee", t4) == configs.dot_kind(4, "tf32", t4) == "fma"


def test_what_no_tile_fits_is_refused_by_name():
    """Where even the smallest tiles spill or overflow a GPU's shared memory, the kernel refuses
    with a ValueError that names the GPU and says what to do, instead of running slowly or failing
    with Triton's OutOfResources."""
    refused = [(capability, key, block_d) for capability, entries in DEFAULTS.items()
               for key, by_dim in entries.items() for block_d, spec in by_dim.items() if spec is None]
    for capability, (name, dtype, precision), block_d in refused:
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        with pytest.raises(ValueError, match=rf"\({archs.ARCHS[capability].name}\) has too little room .* "
                                             rf"Use head dims up to {block_d // 2}"):
            configs.default_config(name, torch_dtype, precision, block_d, archs.ARCHS[capability])
    # today: the backward at head dims 129-256 on a T4, and nothing else
    assert sorted((c, key[:2], d) for c, key, d in refused) == [
        (75, ("bwd_dkdv", "fp16"), 256), (75, ("bwd_dkdv", "fp32"), 256), (75, ("bwd_dq", "fp16"), 256)]


def test_the_defaults_were_chosen_with_every_triton_a_supported_pytorch_installs():
    """PyTorch's CUDA builds pin Triton: 2.11 takes 3.6.0, 2.12.1 and 2.13 3.7.1, 2.14 3.8; the CPU
    builds take the newest (3.9). The defaults compile cleanly under each of them (CI compiles them
    under every one), and the spills no candidate avoids are recorded per release and entry, each
    an entry of the table."""
    assert {"3.6.0", "3.7.1", "3.8.0", "3.9.0"} <= set(defaults.TRITONS)
    for release, entries in defaults.SPILLS.items():
        assert release in defaults.TRITONS, release
        for (capability, name, dtype, precision, block_d), spilled in entries.items():
            assert DEFAULTS[capability][(name, dtype, precision)][block_d] is not None and spilled > 0


def test_spills_fail_under_the_releases_the_defaults_were_chosen_with(monkeypatch):
    """Under a release of defaults.TRITONS a spill fails, beyond what defaults.SPILLS records for it;
    another (newer) release allocates registers its own way: a spill there is shown, not failed.
    Too much shared memory fails under every release."""
    monkeypatch.setattr(defaults, "TRITONS", ("3.6.0", "3.7.1"))
    monkeypatch.setattr(defaults, "SPILLS", {"3.7.1": {(90, "fwd", "fp16", "ieee", 64): 8}})
    item = ("fwd", "fp16", 64, "ieee", (("BLOCK_KV", 64), ("BLOCK_Q", 64)), 4, 2)
    sm90 = archs.ARCHS[90]
    for release, spilled, failed in [((3, 6, 0), 8, True), ((3, 7, 1), 8, False), ((3, 7, 1), 16, True),
                                     ((3, 7, 0), 8, False), ((99, 0, 0), 1024, False)]:
        monkeypatch.setattr(compiled, "triton_release", lambda: release)
        assert (compiled.problem(sm90, item, spilled, 1024) is not None) == failed, (release, spilled)
        assert "shared memory" in compiled.problem(sm90, item, 0, sm90.smem_per_block + 1)
    # the record is per head dim: the same tiles at another head dim (MLA's 192) fail
    monkeypatch.setattr(compiled, "triton_release", lambda: (3, 7, 1))
    assert compiled.problem(sm90, item, 8, 1024, head_dim=48) is not None
    monkeypatch.undo()
    assert compiled.triton_release() == tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])


def _on_sm90(monkeypatch):
    monkeypatch.setattr(configs, "_tensor_cores", lambda: True)
    monkeypatch.setattr(archs, "_assumed", archs.ARCHS[90])
    monkeypatch.setattr(configs, "INTERPRET", False)


def test_highest_float32_multiplies_in_ieee_by_default(monkeypatch):
    """3xTF32 gave wrong gradients and illegal memory accesses on an H200 (triton 3.6): 'highest'
    float32 is IEEE unless FLASHATTN_TF32X3=1 asks; 'high' stays TF32."""
    _on_sm90(monkeypatch)
    monkeypatch.delenv("FLASHATTN_TF32X3", raising=False)
    assert [configs.dot_precision(torch.float32, d) for d in (16, 64, 128, 256, None)] == ["ieee"] * 5
    monkeypatch.setenv("FLASHATTN_TF32X3", "0")
    assert configs.dot_precision(torch.float32, 64) == "ieee"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert configs.dot_precision(torch.float32, 64) == "tf32"


def test_tf32x3_on_request_warns_once_and_stops_at_head_dim_128(monkeypatch):
    """FLASHATTN_TF32X3=1 takes 3xTF32 up to BLOCK_D 128 (past it the backward spills on every
    GPU: IEEE there), with one warning per process that it is experimental."""
    _on_sm90(monkeypatch)
    monkeypatch.setenv("FLASHATTN_TF32X3", "1")
    monkeypatch.setattr(configs, "_TF32X3_WARNED", [])
    with pytest.warns(RuntimeWarning, match="experimental"):
        assert [configs.dot_precision(torch.float32, d) for d in (16, 64, 128, 256)] == ["tf32x3"] * 3 + ["ieee"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert configs.dot_precision(torch.float32, 32) == "tf32x3"  # no second warning
    assert configs.dot_precision(torch.float16, 256) == "ieee"
