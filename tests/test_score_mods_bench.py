"""The score-modification benchmark runs end to end at tiny sizes on the interpreter (on a GPU it
times; here it checks every flashattn output against PyTorch's before writing its rows)."""
import csv

import pytest

import flashattn
from flashattn.measure import score_mods


@pytest.mark.skipif(flashattn.DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_quick_run_writes_every_modification(tmp_path):
    out = tmp_path / "score_mods.csv"
    score_mods.main(["--quick", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {r["modification"] for r in rows} == {"causal", "key-padding", "float-mask", "alibi", "softcap",
                                                "dropout", "bottom-right"}
    checked = [float(r["max_diff"]) for r in rows if r["provider"] == "flashattn" and r["max_diff"]]
    assert len(checked) == 5 * 3  # all but dropout and softcap (FlexAttention is run on GPUs), three modes each
    assert all(r["mode"] in ("fwd", "bwd", "fwd+bwd") and float(r["ms"]) > 0 for r in rows)
