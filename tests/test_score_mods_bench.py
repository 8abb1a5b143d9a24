"""The score-modification benchmark runs end to end at tiny sizes on the interpreter (on a GPU it
times; here it checks every flashattn output against PyTorch's before writing its rows), and the
key-padding case it times beside FlexAttention is the one it means."""
import csv
import math

import pytest
import torch

import flashattn
from flashattn.measure import score_mods


@pytest.mark.skipif(flashattn.DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_quick_run_writes_every_modification(tmp_path):
    out = tmp_path / "score_mods.csv"
    score_mods.main(["--quick", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {r["modification"] for r in rows} == {"dense", "causal", "key-padding", "float-mask", "documents", "alibi",
                                                "softcap", "window", "causal-32k", "window-32k", "dropout",
                                                "dropout-dense", "bottom-right"}
    assert all(r["mode"] in ("fwd", "bwd", "fwd+bwd") and float(r["ms"]) > 0 for r in rows)
    ours = [r for r in rows if r["provider"] == "flashattn"]
    assert len(ours) == 13 * 3 and all(r["max_diff"] == "" and r["flashattn_speedup"] == "" for r in ours)
    peers = [r for r in rows if r["provider"] != "flashattn"]
    # FlexAttention runs on GPUs only: every modification but softcap and the 32k pair has an SDPA row here, each
    # compared with flashattn's output but dropout's (each draws its own mask)
    assert {r["modification"] for r in peers} == {"dense", "causal", "key-padding", "float-mask", "documents", "alibi",
                                                 "window", "dropout", "dropout-dense", "bottom-right"}
    dropout = ("dropout", "dropout-dense")
    assert all(float(r["max_diff"]) <= 0.05 for r in peers if r["modification"] not in dropout)
    assert all(r["max_diff"] == "" for r in peers if r["modification"] in dropout)
    assert all(float(r["flashattn_speedup"]) > 0 for r in peers)
    # each row is timed against its provider's baseline, key padding against the dense kernel
    for r in rows:
        baseline = {"dense": "dense", "key-padding": "dense", "dropout-dense": "dense", "causal-32k": "causal-32k",
                    "window-32k": "causal-32k"}.get(r["modification"], "causal")
        assert r["baseline"] == baseline
        assert float(r["ratio_to_baseline"]) > 0
        assert r["modification"] != r["baseline"] or float(r["ratio_to_baseline"]) == 1.0


def test_cases_picks_modifications_and_their_baselines(tmp_path):
    out = tmp_path / "score_mods.csv"
    score_mods.main(["--quick", "--out", str(out), "--cases", "window-32k,alibi"])
    rows = list(csv.DictReader(out.open()))
    assert {r["modification"] for r in rows} == {"causal-32k", "window-32k", "causal", "alibi"}
    with pytest.raises(ValueError, match="--cases: unknown \\['nope'\\]"):
        score_mods.main(["--quick", "--out", str(out), "--cases", "nope"])


def test_key_padding_keeps_n_three_quarters_half_a_quarter():
    assert score_mods.padding_lengths(4, 8192) == [8192, 6144, 4096, 2048]
    mask = score_mods.key_padding_mask([48, 36, 24, 12], 48, torch.device("cpu"))
    assert mask.shape == (4, 1, 1, 48) and mask.dtype == torch.bool
    assert mask.sum(-1).flatten().tolist() == [48, 36, 24, 12] and mask[:, :, :, 0].all()
    # FlexAttention's mask_mod, evaluated on every (batch, head, query, key), is the same mask
    b, h, i, j = torch.meshgrid(torch.arange(4), torch.arange(2), torch.arange(5), torch.arange(48), indexing="ij")
    dense = score_mods.key_padding_mod(torch.tensor([48, 36, 24, 12]))(b, h, i, j)
    assert torch.equal(dense, mask.expand(4, 2, 5, 48))
    assert torch.equal(score_mods.causal_mod(b, h, i, j), j <= i)


def test_documents_are_causal_within_each_and_the_same_for_flex():
    ids = score_mods.document_ids(5, 64, torch.device("cpu"))
    assert ids.shape == (5, 64)
    assert [torch.bincount(row).tolist() for row in ids[:2]] == [[32, 16, 8, 8], [16, 8, 8, 32]]
    assert torch.equal(ids[4], ids[0])
    mask = score_mods.document_mask(ids)
    assert mask.shape == (5, 1, 64, 64) and mask.dtype == torch.bool
    assert mask[0, 0, 31, :32].all() and not mask[0, 0, 32, :32].any() and mask[0, 0, 32, 32]
    assert not mask.triu(1).any()
    b, h, i, j = torch.meshgrid(torch.arange(5), torch.arange(2), torch.arange(64), torch.arange(64), indexing="ij")
    assert torch.equal(score_mods.document_mod(ids)(b, h, i, j), mask.expand(5, 2, 64, 64))


def test_alibi_bias_in_the_dtype():
    slopes = score_mods.alibi_slopes(4, torch.device("cpu"))
    bias = score_mods.alibi_bias(slopes, 5, 7, torch.device("cpu"), torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == (4, 5, 7)
    assert math.isclose(bias[1, 4, 0].item(), -4 * slopes[1].item(), rel_tol=2 ** -7)
    assert (bias[:, torch.arange(5), torch.arange(5)] == 0).all()
