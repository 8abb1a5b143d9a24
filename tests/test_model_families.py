"""tools/model_families.py: tiny random models of transformers families on flashattn against the
library's own attention. The tool's whole sweep takes minutes on the interpreter; here a few
families that the integration's other tests do not build (a window on one layer of two, multi-head
latent attention with values of another head dim than the keys', GPT-OSS's attention sinks against
eager), and the verdicts the tool gives."""
import os
import sys

import pytest

pytest.importorskip("transformers", reason='transformers is not installed (pip install "flashattn[transformers]")')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import model_families  # noqa: E402  (tools/, after the skip above)


@pytest.mark.parametrize("family, reference", [("qwen2", "sdpa"), ("deepseek_v3", "sdpa"), ("gpt_oss", "eager")])
def test_a_family_agrees_with_its_reference(family, reference):
    """The logits, unpadded and left-padded (generation, minutes on the interpreter, is the
    integration's other tests' and the tool's)."""
    row = model_families.check(family, generate=False)
    assert row["status"] == "pass", row
    assert row["reference"] == reference and row["unpadded"] <= model_families.TOLERANCE and "static" not in row


def test_a_refused_feature_and_an_unknown_family_are_told_apart_from_a_failure(monkeypatch):
    runs = model_families.runs

    def refusing(model, name, *args):
        if name.startswith("fa"):
            raise NotImplementedError("flashattn's transformers integration does not support position_bias")
        return runs(model, name, *args)

    monkeypatch.setattr(model_families, "runs", refusing)
    row = model_families.check("llama", generate=False)
    assert row["status"] == "refused" and "position_bias" in row["detail"]
    monkeypatch.setitem(model_families.FAMILIES, "no_such_family", {})
    row = model_families.check("no_such_family")
    assert row["status"] == "skipped" and "no_such_family" in row["detail"]


def test_a_difference_is_a_failure(monkeypatch):
    """The check can fail: a reference that computes something else (its logits shifted) fails it."""
    runs = model_families.runs

    def shifted(model, name, *args):
        out = runs(model, name, *args)
        return out if name.startswith("fa") else {run: value + 1e-3 for run, value in out.items()}

    monkeypatch.setattr(model_families, "runs", shifted)
    row = model_families.check("llama", generate=False)
    assert row["status"] == "FAIL" and "unpadded: logits 1.0e-03 off" in row["detail"]


def test_the_command_line_names_unknown_families():
    with pytest.raises(SystemExit):
        model_families.main(["no_such_family"])
