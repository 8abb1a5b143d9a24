"""The kernels with their variants switched on (grouped-query attention, sliding windows, packed
sequences; softcap, ALiBi, attn_mask (with its tile lists), dropout, bottom-right alignment) compile for sm_90 on a CPU: the interpreter runs them but never compiles them, and a
compile error would otherwise first show on a GPU."""
import pytest

import flashattn  # noqa: F401  (before triton: on a CPU it picks the interpreter)
from flashattn.measure import compiled


def test_variants_compile_for_sm90():
    try:
        rows = compiled.in_child("flashattn.measure.compiled:variant_report", timeout=900)
    except compiled.CannotCompile as e:
        pytest.skip(str(e))
    assert {(r["kernel"], r["variant"]) for r in rows} == {
        (k, v) for k in ("fwd", "bwd_dkdv", "bwd_dq") for v in ("gqa", "window", "varlen", "all", "mods", "mods-varlen",
                                                                 "float-mask", "bool-mask", "dropout")}
    for r in rows:
        print(r)
        assert r["smem"] <= compiled.SMEM_PER_BLOCK, r
