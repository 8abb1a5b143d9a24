"""A left-padded batch generating through flashattn.integrations.transformers decodes in place:
each step's layers call ``flashattn.decode`` with ``cache_leftpad`` and ``max_seqlen`` on the
cache as transformers holds it (dynamic or static), and nothing in the step is read on the host.

Tiny random-weight models built from their configs (nothing downloaded), float32, against ``sdpa``
(``eager`` for Gemma 2, which transformers refuses SDPA): greedy tokens identical, each step's
logits within a few float32 roundings of theirs.
"""
import gc
import os
import subprocess
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flashattn
from test_integrations_transformers import on_the_kernels_device  # noqa: F401  (autouse)
from test_integrations_transformers import NAME, ROOT, TINY, layer_mask, padded_batch, tiny
from test_integrations_transformers_exact import ATOL, counting_backend, generated

transformers = pytest.importorskip("transformers")
fa_transformers = pytest.importorskip("flashattn.integrations.transformers")
from transformers import masking_utils  # noqa: E402  (after the skips above)

from flashattn.integrations import left_padding  # noqa: E402

#: What waits for a GPU: a value read on the host, or an op whose output size depends on values.
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "argwhere", "masked_select", "unique", "unique_consecutive", "_local_scalar_dense"}
#: Triton's interpreter stands for the GPU here: what it reads is the kernels' own work.
TRITON = os.path.dirname(__import__("triton").__file__)


class HostRead(AssertionError):
    pass


class NoHostReads(TorchFunctionMode):
    """Raise on every torch call in ``HOST_READS`` made outside Triton's interpreter (on a CPU
    nothing waits, so the calls themselves are what is checked)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not any(f.filename.startswith(TRITON) for f in traceback.extract_stack()):
            raise HostRead(f"{name} read on the host during a decoding step")
        return func(*args, **(kwargs or {}))


def watch(model, monkeypatch):
    """Run ``model``'s decoding steps (one new token a row) under ``NoHostReads`` and record each
    ``flashattn.decode`` call: ``(in a step, cache_leftpad given, max_seqlen)``."""
    calls, stepping, forward, decode = [], [], model.forward, flashattn.decode

    def step_forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] != 1:
            return forward(*args, **kwargs)
        stepping.append(True)
        try:
            with NoHostReads():
                return forward(*args, **kwargs)
        finally:
            stepping.pop()

    def recording(*args, **kwargs):
        calls.append((bool(stepping), kwargs.get("cache_leftpad") is not None, kwargs.get("max_seqlen")))
        return decode(*args, **kwargs)

    monkeypatch.setattr(model, "forward", step_forward)
    monkeypatch.setattr(flashattn, "decode", recording)
    return calls


@pytest.mark.parametrize("family, cache", [
    ("llama", "dynamic"), ("llama", "static"),
    ("mistral", "static"),                        # a static cache's sliding layers roll, padding in the window
    ("gemma2", "dynamic"),                        # softcapping, full and sliding layers
    pytest.param("mistral", "dynamic", marks=pytest.mark.slow),
    pytest.param("gemma2", "static", marks=pytest.mark.slow),
])
def test_left_padded_generation_decodes_in_place(family, cache, monkeypatch):
    """3 prompts of 12 tokens with 0, 3 and 7 padding tokens on the left, 5 new tokens: sdpa's or
    eager's tokens and logits; every step's layer is one decode call with cache_leftpad and
    max_seqlen, and the step reads nothing on the host. Mistral's and Gemma 2's windows of 8
    keys hold padding at the first steps (the window is counted in the padded row)."""
    model = tiny(family, **({} if family == "llama" else dict(sliding_window=8)))
    ids, mask = padded_batch("left")
    options = {} if cache == "dynamic" else dict(cache_implementation="static")
    calls = watch(model, monkeypatch)
    tokens, steps = generated(model, NAME, ids, mask, **options)
    monkeypatch.undo()
    their_tokens, their_steps = generated(model, "eager" if family == "gemma2" else "sdpa", ids, mask, **options)
    assert torch.equal(tokens, their_tokens), (tokens[:, ids.shape[1]:], their_tokens[:, ids.shape[1]:])
    torch.testing.assert_close(steps, their_steps, rtol=0, atol=ATOL)
    in_steps = [call for call in calls if call[0]]
    assert len(in_steps) == 4 * model.config.num_hidden_layers, "each step's layers decode"
    assert all(leftpad and max_seqlen is not None for _, leftpad, max_seqlen in in_steps), in_steps


def test_without_padding_a_static_cache_decodes_its_written_slots(monkeypatch):
    """No mask at all: decode reads the slots written so far (the query's offset, on the device),
    never the unwritten ones."""
    model = tiny("llama")
    ids, _ = padded_batch("left", batch=2)
    calls = watch(model, monkeypatch)
    tokens, steps = generated(model, NAME, ids, None, cache_implementation="static")
    monkeypatch.undo()
    their_tokens, their_steps = generated(model, "sdpa", ids, None, cache_implementation="static")
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(steps, their_steps, rtol=0, atol=ATOL)
    # the cache's max_cache_len slots bound the lengths: the prompt and the new tokens fed back
    assert [call for call in calls if call[0]] == [(True, False, ids.shape[1] + 4)] * 8


def forced_steps(model, implementation, ids, mask, forced):
    """Each decoding step's logits ``(steps, B, vocab)`` of ``model`` fed the tokens ``forced``
    (B, steps) after the prompt, the same for every implementation. (Greedy generation on a batch
    padded on the right would go on from the logits of a padding place, which are no token's: its
    first new token may differ by the implementation's choice for padding, not by a fault.)"""
    model.set_attn_implementation(implementation)
    logits = []
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        for t in range(forced.shape[1]):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            logits.append(model(input_ids=forced[:, t:t + 1], attention_mask=mask, cache=cache,
                                use_cache=True).logits[:, -1])
    return torch.stack(logits)


def test_a_right_padded_batch_keeps_the_general_path(monkeypatch):
    """A batch whose first mask is not in the left-padding form (padding on the right) is read so
    once, and its steps take the general path: exact, no cache_leftpad."""
    model = tiny("llama")
    ids, mask = padded_batch("right", batch=2)
    forced = torch.randint(1, TINY["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(5),
                           device="cpu").to(ids.device)  # the CPU's generator, whatever the default device
    seen = []
    decode = flashattn.decode
    monkeypatch.setattr(flashattn, "decode", lambda *a, **kw: seen.append(kw.get("cache_leftpad")) or decode(*a, **kw))
    steps = forced_steps(model, NAME, ids, mask, forced)
    monkeypatch.undo()
    torch.testing.assert_close(steps, forced_steps(model, "sdpa", ids, mask, forced), rtol=0, atol=ATOL)
    assert seen and all(leftpad is None for leftpad in seen)


#: On a GPU the device-side check ends the CUDA context of its process: there it runs in a child.
ON_GPU = flashattn.DEVICE.type == "cuda"
HOLED_CHILD = ("import torch; from flashattn.integrations import left_padding; "
               "left_padding.first_keys(torch.tensor([[1, 1, 1, 0, 1]], dtype=torch.bool, device='cuda')); "
               "torch.cuda.synchronize()")


@pytest.mark.skipif(ON_GPU, reason="the device-side assert would end this process's CUDA context; "
                                   "test_the_form_and_the_first_keys checks it on a GPU in a child process")
def test_a_step_that_leaves_the_form_is_refused():
    """A left-padded first call, then a step whose mask has a zero after a one (which decode's
    span cannot hold): refused by the device-side check, not computed as if it were in the form."""
    model = tiny("llama")
    model.set_attn_implementation(NAME)
    ids, mask = padded_batch("left")
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        holed = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=-1)
        holed[0, 4] = 0                                    # row 0 had no padding: a hole
        with pytest.raises(RuntimeError, match="left-padding form"):
            model(input_ids=ids[:, :1], attention_mask=holed, cache=cache, use_cache=True)
    from flashattn.integrations.left_padding import BROKEN_FORM
    assert len(BROKEN_FORM) < 255, "CUDA's torch._assert_async refuses longer messages"


def test_compiled_static_generation_with_padding_in_the_window():
    """generate compiles its steps (fullgraph, aot_eager) and makes their masks in advance, with
    flashattn's mask function, outside the graph: the masks it hands back (Mistral's window of 8
    keys, padding in it) are read as the layer's keys' own; the compiled steps take the general
    path (decode is not traced). sdpa's tokens and logits."""
    model = tiny("mistral", sliding_window=8)
    ids, mask = padded_batch("left")
    graphs = []
    config = transformers.CompileConfig(fullgraph=True, backend=counting_backend(graphs), mode=None)
    config._compile_all_devices = True   # transformers compiles on GPUs only, unless asked
    torch._dynamo.reset()
    tokens, steps = generated(model, NAME, ids, mask, cache_implementation="static", compile_config=config)
    assert graphs, "the decoding steps were not compiled"
    their_tokens, their_steps = generated(model, "sdpa", ids, mask, cache_implementation="static",
                                          disable_compile=True)
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(steps, their_steps, rtol=0, atol=ATOL)


# -- The pieces -----------------------------------------------------------------------------------------

def test_the_form_and_the_first_keys():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert left_padding.has_form(mask)
    assert left_padding.first_keys(mask).tolist() == [2, 0, 5]
    # a row holding fewer entries: its first key at most its length
    assert left_padding.first_keys(mask, torch.tensor([3, 5, 2])).tolist() == [2, 0, 2]
    holed = torch.tensor([[1, 1, 1, 0, 1]], dtype=torch.bool)
    assert not left_padding.has_form(holed) and not left_padding.has_form(~mask)
    if ON_GPU:  # the program stops at the device-side assert, with the message
        child = subprocess.run([sys.executable, "-c", HOLED_CHILD], capture_output=True, text=True, timeout=300,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
        assert child.returncode != 0 and "left-padding form" in child.stderr, child.stderr[-2000:]
    else:
        with pytest.raises(RuntimeError, match="left-padding form"):
            left_padding.first_keys(holed)
    # the hole past the entries the row holds does not count
    assert left_padding.first_keys(holed, torch.tensor([3])).tolist() == [0]


def test_a_batch_is_read_once_and_remembered_per_model():
    batches = left_padding.Batches()
    one, other = transformers.LlamaConfig(), transformers.LlamaConfig()
    left = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert batches.remember(one, left) and not batches.predicts_form(other, left)
    assert batches.predicts_form(one, torch.ones(2, 7, dtype=torch.bool))
    assert not batches.predicts_form(one, torch.ones(3, 7, dtype=torch.bool))   # another batch size
    assert not batches.remember(one, torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool))
    assert not batches.predicts_form(one, left) and not batches.predicts_form(None, left)
    del one   # a model gone: forgotten at the next batch read
    gc.collect()
    batches.remember(other, left)
    assert len(batches._seen) == 1 and batches.predicts_form(other, left)
    assert not batches.forget(other) and not batches.predicts_form(other, left)   # a batch not read


@torch.no_grad()   # a batch's form is read at a first call without gradients (decode takes none)
def test_the_mask_function_answers_a_span_beside_a_plain_mask():
    """A step of a left-padded batch: the layer's 2-D key mask, a plain tensor, with its span kept
    beside it; a static cache's step: transformers' 4-D mask with the slots written so far."""
    causal = masking_utils.causal_mask_function
    config = transformers.LlamaConfig()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert layer_mask(2, 5, 5, 0, 0, causal, mask, config=config).shape == (2, 5)  # first call
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], dim=-1)
    answer = layer_mask(2, 1, 6, 5, 0, causal, step, config=config)
    assert type(answer) is torch.Tensor and torch.equal(answer, step)
    leftpad, seqlens, pattern = fa_transformers.SPANS.of(answer)
    assert leftpad.tolist() == [2, 0] and seqlens.tolist() == [6, 6] and pattern == (True, None, None)
    static = layer_mask(2, 1, 10, torch.tensor(5), 0, causal, step, config=config)
    leftpad, seqlens, _ = fa_transformers.SPANS.of(static)
    assert static.shape == (2, 1, 1, 10) and leftpad.tolist() == [2, 0] and seqlens.tolist() == [6, 6]
    # handed back (generate makes a static cache's masks in advance): read as the keys' own
    window = masking_utils.sliding_window_causal_mask_function(4)
    keys = layer_mask(2, 1, 4, 5, 2, window, step, config=config)
    assert torch.equal(keys, step[:, 2:]) and torch.equal(
        layer_mask(2, 1, 4, 5, 2, window, keys, config=config), keys)
    # with gradients a first call is not read, and the batch's steps take the general path
    with torch.enable_grad():
        layer_mask(2, 5, 5, 0, 0, causal, mask, config=config)
    assert fa_transformers.SPANS.of(layer_mask(2, 1, 6, 5, 0, causal, step, config=config)) is None

