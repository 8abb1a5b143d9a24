"""The training-step benchmark at tiny sizes on the interpreter (on a GPU it times): every
implementation runs the same step, and flashattn's loss and gradients agree with sdpa's."""
import csv

import pytest

import flashattn

pytest.importorskip("transformers")
from flashattn.measure import bench_train  # noqa: E402  (after the skip above)


@pytest.mark.skipif(flashattn.DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_quick_run_writes_every_implementation(tmp_path, capsys):
    out = tmp_path / "train.csv"
    bench_train.main(["--quick", "--profile", "--out", str(out)])
    printed = capsys.readouterr().out
    for row in ("flashattn", "flashattn-deterministic", "sdpa"):  # --profile: each step's table first
        assert f"== {row}\n" in printed, printed
    assert printed.count("(profiled), kernels") == 3 and "aten::" in printed
    rows = list(csv.DictReader(out.open()))
    assert [r["implementation"] for r in rows] == ["flashattn", "flashattn-deterministic", "sdpa"]
    assert all(float(r["step_ms"]) > 0 for r in rows) and rows[2]["of_sdpa"] == "1.000"
    # float32 on the interpreter: the same loss and gradients as sdpa's, to float32's rounding
    assert all(float(r["loss_diff"]) < 1e-5 and float(r["grad_diff"]) < 1e-4 for r in rows), rows


def test_fused_config_entries_are_read_as_json():
    """``--fused-config HEAD_SPLIT=4 PREFETCH=false``: each entry a key and a JSON value; an entry
    without '=' is refused by argparse, naming it."""
    import argparse
    assert bench_train.config_entry("HEAD_SPLIT=4") == ("HEAD_SPLIT", 4)
    assert bench_train.config_entry("PREFETCH=false") == ("PREFETCH", False)
    with pytest.raises(argparse.ArgumentTypeError, match="HEAD_SPLIT"):
        bench_train.config_entry("HEAD_SPLIT")
