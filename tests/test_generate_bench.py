"""The generation benchmark's parts that run without a GPU: its left-padded prompts, its decoding
step (the same step at every call), and the whole run at tiny sizes on the interpreter (on a GPU
it times; here it checks that every implementation runs and that flashattn's steps decode in
place)."""
import csv

import pytest
import torch

import flashattn

pytest.importorskip("transformers")
from flashattn.measure import bench_generate  # noqa: E402  (after the skip above)


def test_left_padded_prompts():
    ids, mask, pads = bench_generate.left_padded_prompts(6, 700, 100, "cpu")
    assert pads == [0, 58, 116, 175, 233, 291] and ids.shape == mask.shape == (6, 700)
    assert mask.sum(-1).tolist() == [700 - p for p in pads]
    assert all(mask[b, pads[b]:].all() and not mask[b, :pads[b]].any() for b in range(6))
    assert bool((ids[mask == 0] == 0).all()) and bool((ids[mask == 1] > 0).all())


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_each_call_is_the_same_step(kind):
    """The step crops the cache back: a second call gives the first's logits, and the sdpa step is
    the model's next-token logits on the prompt's cache as generate computes them."""
    model = bench_generate.llama(2, 64, 4, 2, 128, 128, 32, torch.float32, flashattn.DEVICE)
    ids, mask, _ = bench_generate.left_padded_prompts(3, 12, 128, flashattn.DEVICE)
    model.set_attn_implementation("sdpa")
    step, first = bench_generate.decoding_step(model, ids, mask, kind, 20)
    assert torch.equal(step(), first)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True,
                         cache_implementation=kind if kind == "static" else None)
    torch.testing.assert_close(first[:, -1], out.logits[1], rtol=0, atol=1e-5)


@pytest.mark.skipif(flashattn.DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_quick_run_writes_every_implementation(tmp_path, capsys):
    out = tmp_path / "generate.csv"
    bench_generate.main(["--quick", "--profile", "--profile-rows", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    # --profile: each implementation's step under torch.profiler, then its host under cProfile
    assert printed.count("(profiled), kernels") == 3 and printed.count("steps under cProfile") == 3
    rows = list(csv.DictReader(out.open()))
    assert [r["implementation"] for r in rows] == ["flashattn", "sdpa", "eager"]
    ours = rows[0]
    assert ours["in_place"] == ours["layers"] == "2", "every layer's step decodes in place"
    assert all(r["same_tokens"] == "yes" for r in rows) and all(float(r["step_ms"]) > 0 for r in rows)
    assert rows[1]["of_sdpa"] == "1.000" and rows[2]["of_eager"] == "1.000"
