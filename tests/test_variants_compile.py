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


def test_dropout_draws_eight_pairs_per_philox_call():
    """Compiled for sm_90, the forward draws dropout's bits with an eighth of the Philox rounds per
    tile when one call serves 8 pairs of a row (DROP_TILE) as when each pair runs its own
    (DROP_PAIR, packed sequences): two ``mul.hi.u32`` per round."""
    import re

    jobs = [dict(kernel="fwd", dtype="bf16", num_warps=8, num_stages=3,
                 constexprs=dict(BLOCK_Q=128, BLOCK_KV=64, HEAD_DIM=128, BLOCK_D=128, IS_CAUSAL=True,
                                 DOT_PRECISION="ieee", DROPOUT=kind)) for kind in (1, 2)]
    try:
        tile, pair = (len(re.findall(r"\bmul\.hi\.u32\b", ptx)) for ptx in compiled.ptx_of_many(jobs, timeout=900))
    except compiled.CannotCompile as e:
        pytest.skip(str(e))
    print(f"mul.hi.u32: {tile} drawing 8 pairs per call, {pair} pair by pair")
    assert 0 < 8 * tile <= pair * 1.1 and 8 * tile >= pair * 0.9
