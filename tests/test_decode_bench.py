"""The decode benchmark's paged run works end to end at tiny sizes on the interpreter (on a GPU it
times; here it checks each paged output against the contiguous one before writing its rows)."""
import csv

import pytest

import flashattn
from flashattn.measure import bench_decode


@pytest.mark.skipif(flashattn.DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_quick_paged_run_writes_every_provider(tmp_path):
    out = tmp_path / "decode_paged.csv"
    bench_decode.main(["--paged", "--quick", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert {(r["cache_len"], r["page_size"], r["provider"]) for r in rows} == {
        (n, "", p) for n in ("40", "69") for p in ("decode", "sdpa-gqa")} | {
        (n, s, p) for n in ("40", "69") for s in ("16", "32") for p in ("decode-paged", "sdpa-gqa-gather")}
    checked = [float(r["max_diff"]) for r in rows if r["provider"] == "decode-paged"]
    assert len(checked) == 4 and all(d <= 1e-2 for d in checked)
    assert all(float(r["ms"]) > 0 for r in rows)


def test_paged_inputs_hold_the_contiguous_cache():
    import torch

    from flashattn.testing.reference import gather_pages

    k = torch.randn(2, 3, 37, 8)
    k_pages, v_pages, table = bench_decode.paged_inputs(k, -k, 16)
    assert k_pages.shape == (6, 16, 3, 8) and table.shape == (2, 3) and sorted(table.flatten().tolist()) == list(range(6))
    assert torch.equal(gather_pages(k_pages, table)[:, :, :37], k)
    assert torch.equal(gather_pages(v_pages, table)[:, :, :37], -k)
    assert (gather_pages(k_pages, table)[:, :, 37:] == 0).all()
