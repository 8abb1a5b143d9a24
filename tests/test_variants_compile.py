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
                                                                 "float-mask", "bool-mask", "key-padding", "dropout")}
    for r in rows:
        print(r)
        assert r["smem"] <= compiled.SMEM_PER_BLOCK, r


def test_helper_kernels_compile_for_sm90():
    """The tile classes of a mask and the dropout mask a call returns compile for sm_90 (the
    interpreter lets a kernel read a plain global, which the compiler refuses)."""
    try:
        rows = compiled.in_child("flashattn.measure.compiled:helper_report", timeout=600)
    except compiled.CannotCompile as e:
        pytest.skip(str(e))
    assert [r["kernel"] for r in rows] == ["mask_classes", "dropout_mask"]
    assert all(r["spilled"] == 0 for r in rows), rows


def test_dropout_draws_eight_pairs_per_philox_call():
    """Compiled for sm_90, the forward runs one Philox call (10 rounds, two ``mul.hi.u32`` each) per
    8 pairs a thread holds: the 32 pairs of a 128 x 64 tile on 8 warps take 4 calls, in each of the
    causal forward's two loops (the pairs of one call are those a thread holds, tiles.dropout_keep;
    one call per pair, as before, made 1024)."""
    import re

    job = dict(kernel="fwd", dtype="bf16", num_warps=8, num_stages=3,
               constexprs=dict(BLOCK_Q=128, BLOCK_KV=64, HEAD_DIM=128, BLOCK_D=128, IS_CAUSAL=True,
                               DOT_PRECISION="ieee", DROPOUT=1))
    try:
        (ptx,) = compiled.ptx_of_many([job], timeout=900)
    except compiled.CannotCompile as e:
        pytest.skip(str(e))
    rounds = len(re.findall(r"\bmul\.hi\.u32\b", ptx)) / 2
    print(f"Philox rounds in the forward's PTX: {rounds:.0f}")
    pairs_per_thread = 128 * 64 // (8 * 32)
    assert 0 < rounds <= 2 * (pairs_per_thread // 8) * 10
