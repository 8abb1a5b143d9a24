"""The exercise checkers of chapter 08 pass the notebook's solutions and reject stubs and
plausible wrong answers with a message that names the mistake.

The solutions here are the same as in the solution cells of notebooks/08_performance.ipynb."""
import re

import flashattn  # first: it picks the runtime (TRITON_INTERPRET) before triton is imported
import pytest
import torch

from flashattn import exercises as ex
from flashattn import tuning


# Exercise 1: FLOPs and minimal bytes ----------------------------------------------------------

def attention_cost(batch, heads, n_q, n_kv, head_dim, causal, mode, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    flops = 4 * batch * heads * n_q * n_kv * head_dim
    if causal:
        flops *= 0.5
    if mode == "bwd":
        flops *= 2.5
    if mode == "fwd":   # read Q, K, V; write O; write the LSE (float32)
        tensor_bytes = (2 * n_q + 2 * n_kv) * head_dim * e
    else:               # read Q, K, V, O, dO, LSE; write dQ, dK, dV
        tensor_bytes = (4 * n_q + 4 * n_kv) * head_dim * e
    return flops, batch * heads * (tensor_bytes + 4 * n_q)


def stub(*args, **kwargs):
    raise NotImplementedError()


def _cost_variant(**change):
    """attention_cost with one mistake."""
    def wrong(batch, heads, n_q, n_kv, head_dim, causal, mode, dtype):
        flops, n_bytes = attention_cost(batch, heads, n_q, n_kv, head_dim, causal, mode, dtype)
        e = torch.empty((), dtype=dtype).element_size()
        if change.get("no_causal") and causal:
            flops *= 2
        if change.get("no_bwd_factor") and mode == "bwd":
            flops /= 2.5
        if change.get("bytes_halved") and causal:
            n_bytes /= 2
        if change.get("fp32_bytes"):
            n_bytes = ex._ch08_bytes(batch, heads, n_q, n_kv, head_dim, mode, 4)
        if change.get("no_lse"):
            n_bytes -= 4 * batch * heads * n_q
        if change.get("bwd_as_fwd") and mode == "bwd":
            n_bytes = ex._ch08_bytes(batch, heads, n_q, n_kv, head_dim, "fwd", e)
        if change.get("mac_as_one"):
            flops /= 2
        return flops, n_bytes
    return wrong


def test_attention_cost_solution_passes(capsys):
    ex.check_attention_cost(attention_cost)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (_cost_variant(no_causal=True), "WITHOUT the causal halving"),
    (_cost_variant(no_bwd_factor=True), "2.5x the forward"),
    (_cost_variant(mac_as_one=True), "each multiply-add is 2 FLOPs"),
    (_cost_variant(bytes_halved=True), "halves the FLOPs, not the bytes"),
    (_cost_variant(fp32_bytes=True), "assumes 4 bytes per element"),
    (_cost_variant(no_lse=True), "the LSE is missing"),
    (_cost_variant(bwd_as_fwd=True), "forward's traffic"),
    (lambda *a: 1.0, "should return a tuple"),
    (lambda *a: (2.2e12, 1.07e9), "FLOPs"),  # hard-coded: the reference setting only
])
def test_attention_cost_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=re.escape(words)):
        ex.check_attention_cost(wrong)


# Exercise 2: the resources of a configuration --------------------------------------------------

def estimate_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size):
    block_d = max(16, 1 << (head_dim - 1).bit_length())          # tuning.block_d
    if kernel == "bwd_dkdv":
        resident, streamed = block_kv, block_q                     # K, V stay; Q, dO stream
    else:
        resident, streamed = block_q, block_kv                     # Q (and dO) stay; K, V stream
    accumulators, scores = {"fwd": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (1, 2)}[kernel]
    values = accumulators * resident * block_d + scores * resident * streamed
    resident_tiles = 1 if kernel == "fwd" else 2
    smem = (resident_tiles * resident + num_stages * 2 * streamed) * block_d * element_size
    return values / (num_warps * 32), smem


def _resources_variant(**change):
    def wrong(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size):
        if change.get("no_pad"):
            return ex._ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                                      pad=False)
        if change.get("swapped"):
            return ex._ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                                      dkdv_resident_kv=False)
        if change.get("one_acc"):
            return ex._ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                                      accumulators=(1, 1))
        values, smem = estimate_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size)
        if change.get("per_warp"):
            values *= 32
        if change.get("one_per_stage"):
            smem = ex._ch08_resources(kernel, block_q, block_kv, head_dim, num_warps, num_stages, element_size,
                                      kv_per_stage=1)[1]
        if change.get("fp32_smem"):
            smem = smem // element_size * 4
        return values, smem
    return wrong


def test_estimate_resources_solution_passes(capsys):
    ex.check_estimate_resources(estimate_resources)
    out = capsys.readouterr().out
    assert "PASSED" in out and "over the register limit" in out


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (_resources_variant(no_pad=True), "the kernels pad the head dim"),
    (_resources_variant(swapped=True), "the KEY tile is resident"),
    (_resources_variant(one_acc=True), "accumulates two tiles"),
    (_resources_variant(per_warp=True), "that is per warp"),
    (_resources_variant(one_per_stage=True), "TWO streamed tiles"),
    (_resources_variant(fp32_smem=True), "stored in the input dtype"),
    (lambda *a: (96.0, 131072), "expected"),  # hard-coded: the tuned forward at D 128, bf16
])
def test_estimate_resources_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=re.escape(words)):
        ex.check_estimate_resources(wrong)


def test_reference_rule_is_the_package_rule():
    """The checkers' spelled-out rule says what flashattn.tuning.fits says, on every case."""
    for kernel, bq, bkv, hd, warps, stages, e in ex._ch08_resource_cases():
        config = ex._ch08_config(bq, bkv, warps, stages)
        assert ex._ch08_fits(kernel, bq, bkv, hd, warps, stages, e) == tuning.fits(kernel, config,
                                                                                   tuning.block_d(hd), e)


# Exercise 3: choosing a configuration -----------------------------------------------------------

def choose_config(kernel, head_dim, element_size):
    best = None
    for block_q in (16, 32, 64, 128):
        for block_kv in (16, 32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (1, 2, 3):
                    values, smem = estimate_resources(kernel, block_q, block_kv, head_dim, num_warps,
                                                      num_stages, element_size)
                    if values > 160 or smem > 227 * 1024:
                        continue
                    if kernel == "bwd_dkdv" and block_kv % block_q:
                        continue
                    resident = block_kv if kernel == "bwd_dkdv" else block_q
                    # big score tiles first (up to 128 x 64), then a deeper pipeline, then a taller
                    # resident tile, then fewer warps
                    score = (min(block_q * block_kv, 128 * 64), num_stages, resident, -num_warps)
                    if best is None or score > best[0]:
                        best = (score, dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, num_warps=num_warps,
                                            num_stages=num_stages))
    return best[1]


def test_choose_config_solution_passes(capsys):
    ex.check_choose_config(choose_config)
    out = capsys.readouterr().out
    assert "PASSED" in out
    # For 16-bit inputs at head dim 128 the rule picks the forward's measured winner on the H200.
    assert choose_config("fwd", 128, 2) == dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=8, num_stages=3)


def _fixed(config):
    return lambda kernel, head_dim, element_size: dict(config)


@pytest.mark.parametrize("wrong,words", [
    (stub, "not implemented yet"),
    (_fixed(dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=8, num_stages=3)), "shared memory"),
    (_fixed(dict(BLOCK_Q=128, BLOCK_KV=128, num_warps=4, num_stages=1)), "registers"),
    (_fixed(dict(BLOCK_Q=16, BLOCK_KV=16, num_warps=4, num_stages=2)), "only 16 x 16"),
    (lambda kernel, head_dim, e: dict(BLOCK_Q=128, BLOCK_KV=64, num_warps=4, num_stages=2) if kernel == "bwd_dkdv"
     else choose_config(kernel, head_dim, e), "BLOCK_Q must divide BLOCK_KV"),
    (_fixed(dict(BLOCK_Q=100, BLOCK_KV=64, num_warps=4, num_stages=2)), "powers of two"),
    (_fixed(dict(BLOCK_Q=64, BLOCK_KV=64, num_warps=6, num_stages=2)), "num_warps must be 4 or 8"),
    (_fixed(dict(BLOCK_Q=64, BLOCK_KV=64)), "missing"),
    (lambda *a: (64, 64, 4, 2), "should return a dict"),
])
def test_choose_config_mistakes(wrong, words):
    with pytest.raises(ex.ExerciseError, match=re.escape(words)):
        ex.check_choose_config(wrong)
