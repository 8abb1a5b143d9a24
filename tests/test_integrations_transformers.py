"""Hugging Face transformers models on flashattn (flashattn.integrations.transformers).

Tiny random-weight models built from their configs (nothing downloaded), each run with flashattn
and with transformers' SDPA attention (eager where SDPA lacks the feature) on the same weights, in
float32. The tolerance is the course's rule: the error against the same model in float64 within
2x SDPA's own float32 error (3x for gradients), plus the rule's floor of a few float32 roundings at
the size of the values. Generation must give the very same greedy tokens.
"""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashattn
from flashattn.testing.rule import floor, max_error

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "flashattn[transformers]")')
fa_transformers = pytest.importorskip("flashattn.integrations.transformers")
from transformers import masking_utils  # noqa: E402  (after the skip above)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = fa_transformers.register()
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
#: Mistral repeats what Llama checks, with a window: marked slow where the file would pass 60 s.
MISTRAL_SLOW = pytest.param("mistral", marks=pytest.mark.slow)


def layer_mask(*args, **kwargs):
    """The integration's mask function called as transformers calls it: with the device."""
    return fa_transformers.layer_mask(*args, device=flashattn.DEVICE, **kwargs)


@pytest.fixture(autouse=True)
def on_the_kernels_device():
    """Models and tensors are made where the kernels run (the GPU where there is one): torch's
    default device for the test. The modules of the integration's other tests import it too."""
    with torch.device(flashattn.DEVICE):
        yield


def tiny(family, **extra):
    """A tiny random model of ``family`` ("llama": grouped heads; "mistral": a sliding window of
    5, shorter than the sequences; "gemma2": logit softcapping and a sliding window), in eval mode."""
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**{**TINY, **extra})
        model = transformers.LlamaForCausalLM(config)
    elif family == "mistral":
        config = transformers.MistralConfig(**{**TINY, "sliding_window": 5, **extra})
        model = transformers.MistralForCausalLM(config)
    else:  # "gemma2", or "gemma2-nocap": its windows on every other layer and its scaling alone
        options = dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=24, final_logit_softcapping=None,
                       attn_logit_softcapping=None if family == "gemma2-nocap" else 20.0)
        config = transformers.Gemma2Config(**TINY, **{**options, **extra})
        model = transformers.Gemma2ForCausalLM(config)
    return model.eval()


def baseline_of(family):
    return "eager" if family.startswith("gemma2") else "sdpa"   # transformers refuses SDPA for Gemma 2


def logits(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs).logits


def padded_batch(side, batch=3, length=12):
    """Random tokens and a mask with 0, 3 and 7 padding tokens on the left or right."""
    torch.manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate((0, 3, 7)[:batch]):
        if pad and side == "left":
            mask[row, :pad] = 0
        elif pad:
            mask[row, length - pad:] = 0
    return ids, mask


def check_rule(ours, baseline, ref64, factor=2.0, what="logits"):
    """The rule: ours against float64 within ``factor`` x the baseline's error plus the floor."""
    error, base = max_error(ours, ref64), max_error(baseline, ref64)
    bound = factor * base + floor(ref64, torch.float32)
    assert error <= bound, \
        f"{what}: error {error:.2e} > {factor:.0f} x baseline's {base:.2e} + floor = {bound:.2e}"
    return error, base


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma2-nocap"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_logits(family, side):
    model = tiny(family)
    ids, mask = padded_batch(side)
    ours, theirs = logits(model, NAME, input_ids=ids, attention_mask=mask), \
        logits(model, baseline_of(family), input_ids=ids, attention_mask=mask)
    # The float64 reference runs each row's tokens alone, at their positions in the padded row:
    # eager attention in float64 turns padding into NaN that its matmul carries to the tokens.
    model64, tokens = copy.deepcopy(model).double(), mask.bool()
    ref64 = torch.cat([logits(model64, baseline_of(family), input_ids=ids[row, tokens[row]][None],
                              position_ids=torch.arange(ids.shape[1])[tokens[row]][None])[0]
                       for row in range(ids.shape[0])])
    check_rule(ours[tokens], theirs[tokens], ref64)


@pytest.mark.parametrize("family", ["llama", MISTRAL_SLOW])
def test_packed_sequences_logits(family):
    """Three sequences packed in one row, position_ids restarting at 0 and no mask, as
    padding-free training feeds them: each sequence sees only itself."""
    model = tiny(family)
    lengths = (6, 9, 4)
    torch.manual_seed(2)
    ids = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    # Without a cache: transformers' masks find packed sequences only then.
    inputs = dict(input_ids=ids, position_ids=positions, use_cache=False)
    ours, theirs = logits(model, NAME, **inputs), logits(model, "sdpa", **inputs)
    ref64 = logits(copy.deepcopy(model).double(), "sdpa", **inputs)
    check_rule(ours, theirs, ref64)
    # and as separate sequences: the packing changed nothing
    start = 0
    for n in lengths:
        alone = logits(model, NAME, input_ids=ids[:, start:start + n])
        torch.testing.assert_close(ours[:, start:start + n], alone, rtol=0, atol=1e-5)
        start += n


@pytest.mark.parametrize("family", ["llama", MISTRAL_SLOW])
def test_gradients_of_a_padded_batch(family):
    """The loss's gradients with respect to every parameter, through a left-padded batch."""
    model = tiny(family).train()   # attention_dropout is 0: training changes nothing else
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)

    def grads(m, implementation):
        m.set_attn_implementation(implementation)
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    ours, theirs = grads(model, NAME), grads(model, "sdpa")
    ref64 = grads(copy.deepcopy(model).double(), "sdpa")
    check_rule(ours, theirs, ref64, factor=3.0, what="gradients")


@pytest.mark.parametrize("family, side", [("llama", "none"), ("mistral", "left"),
                                          pytest.param("llama", "left", marks=pytest.mark.slow),
                                          pytest.param("mistral", "none", marks=pytest.mark.slow),
                                          pytest.param("gemma2-nocap", "left", marks=pytest.mark.slow)])
def test_greedy_generation_with_the_cache(family, side, monkeypatch):
    """model.generate with the KV cache: the queries are shorter than the keys, masked
    bottom-right (Mistral's window of 5 slides over the 12 + 5 tokens; Gemma 2's cache holds only
    the window on its sliding layers)."""
    model = tiny(family)
    ids, mask = padded_batch("left", batch=2)
    if side == "none":
        mask = torch.ones_like(mask)
    tokens, decoded = {}, []
    decode = flashattn.decode
    monkeypatch.setattr(flashattn, "decode", lambda *a, **kw: decoded.append(1) or decode(*a, **kw))
    for implementation in (NAME, baseline_of(family)):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                                do_sample=False, pad_token_id=0)
    theirs = tokens[baseline_of(family)]
    assert torch.equal(tokens[NAME], theirs), (tokens[NAME][:, -5:], theirs[:, -5:])
    assert len(decoded) == 4 * TINY["num_hidden_layers"], "each new token after the first is a decoding step"


@pytest.mark.parametrize("family", ["llama", MISTRAL_SLOW])
def test_a_prompt_in_two_chunks_with_gradients(family):
    """A left-padded prompt fed in two chunks through the cache, with gradients on: the second
    chunk's 4 queries see 12 keys, bottom-right, and each row's padding gives it its own offset
    (one varlen_attention call aligned bottom-right within each sequence; decode has no backward)."""
    model = tiny(family)
    ids, mask = padded_batch("left")
    first, second = 8, 4

    def second_chunk(m, implementation):
        m.set_attn_implementation(implementation)
        with torch.no_grad():
            cache = m(input_ids=ids[:, :first], attention_mask=mask[:, :first],
                      use_cache=True).past_key_values
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, first:]
        out = m(input_ids=ids[:, first:], attention_mask=mask, cache=cache,
                position_ids=positions, use_cache=True).logits
        out.sum().backward()
        return out.detach()

    model.zero_grad()
    ours = second_chunk(model, NAME)
    ours_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    theirs = second_chunk(model, "sdpa")
    theirs_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model64 = copy.deepcopy(model).double()
    model64.zero_grad()
    ref64 = second_chunk(model64, "sdpa")
    ref_grad = torch.cat([p.grad.flatten() for p in model64.parameters() if p.grad is not None])
    check_rule(ours, theirs, ref64)
    check_rule(ours_grad, theirs_grad, ref_grad, factor=3.0, what="gradients")


def test_register_refuses_names_transformers_takes():
    assert NAME == fa_transformers.DEFAULT_NAME and "flash" not in NAME
    assert fa_transformers.register("course_attention") == "course_attention"
    for name in ("flashattn", "kernels-community/flash-attn2", "sdpa"):
        with pytest.raises(ValueError, match="taken by transformers"):
            fa_transformers.register(name)
    model = tiny("llama")
    model.set_attn_implementation("course_attention")
    assert model.config._attn_implementation == "course_attention"


def test_sliding_window_is_counted_as_transformers_counts_it():
    """transformers' sliding_window=w lets a query see itself and the w - 1 keys before it."""
    assert fa_transformers.window_of(5, causal=True) == (4, 0)
    assert fa_transformers.window_of(None, causal=True) == (-1, -1)
    assert fa_transformers.window_of(3, causal=False) == (2, 2)   # |i - j| < 3, as its FlashAttention path
    with pytest.raises(ValueError, match="sliding_window"):
        fa_transformers.window_of(0, causal=True)


def reference_bottom_right(q, k, v, lengths_q, lengths_k, left):
    """Plain PyTorch, sequence by sequence: causal aligned bottom-right, a window of ``left``."""
    out, sq, sk = [], 0, 0
    for nq, nk in zip(lengths_q, lengths_k):
        i = torch.arange(nq)[:, None] + (nk - nq)
        j = torch.arange(nk)[None]
        allowed = (j <= i) & ((j >= i - left) if left >= 0 else True)
        qs, ks, vs = (t.transpose(0, 1) for t in (q[sq:sq + nq], k[sk:sk + nk], v[sk:sk + nk]))
        ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0) for t in (ks, vs))
        o = torch.nn.functional.scaled_dot_product_attention(qs.double(), ks.double(), vs.double(),
                                                             attn_mask=allowed)
        out.append(torch.where(allowed.any(-1)[:, None, None], o.transpose(0, 1), 0.0))
        sq, sk = sq + nq, sk + nk
    return torch.cat(out).float()


@pytest.mark.parametrize("left, grad", [(-1, False), (2, True)])
def test_bottom_right_masking_of_packed_sequences(left, grad):
    """Sequences whose keys outnumber their queries by different offsets (0, 3, 9, one without
    queries): one varlen_attention call aligned bottom-right within each sequence, or decode."""
    lengths_q, lengths_k = [5, 1, 3, 0], [5, 4, 12, 6]
    torch.manual_seed(3)
    q = torch.randn(sum(lengths_q), 4, 16)
    k, v = (torch.randn(sum(lengths_k), 2, 16) for _ in range(2))
    call = fa_transformers.Call(scale=None, causal=True, window=(left, 0), dropout=0.0, softcap=None,
                                gqa=True)
    inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out = call.packed(*inputs, lengths_q, lengths_k)
    torch.testing.assert_close(out, reference_bottom_right(q, k, v, lengths_q, lengths_k, left),
                               rtol=0, atol=1e-5)
    # one query in every sequence with queries: decode's path when no gradient is asked for
    out = call.packed(inputs[0][:3], *inputs[1:], [1, 1, 1, 0], lengths_k)
    torch.testing.assert_close(out, reference_bottom_right(q[:3], k, v, [1, 1, 1, 0], lengths_k, left),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("left", [-1, 2])
def test_bottom_right_masking_of_a_whole_batch(left):
    """No padding, 3 queries against 10 keys, with gradients (flashattn.attention and a window
    aligned bottom-right) and without (flashattn.decode)."""
    torch.manual_seed(4)
    q = torch.randn(2, 4, 3, 16)
    k, v = (torch.randn(2, 2, 10, 16) for _ in range(2))
    call = fa_transformers.Call(scale=0.3, causal=True, window=(left, 0), dropout=0.0, softcap=None, gqa=True)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # noqa: E731
    expected = reference_bottom_right(flat(q) / 0.25 * 0.3, flat(k), flat(v), [3, 3], [10, 10], left)
    for grad in (True, False):
        inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = call.dense(*inputs)
        assert out.requires_grad == grad
        torch.testing.assert_close(flat(out.detach()), expected, rtol=0, atol=1e-5)


class HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's values on the host (a synchronisation on a GPU)."""
    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.name() in self.READS
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_nothing_per_layer():
    """A training step (forward and backward, a cache made as transformers makes it by default)
    reads as many values on the host as sdpa's: none for rows that are one sequence each; for
    sequences packed in one row, their lengths once per forward, not once per layer."""
    model = tiny("llama", num_hidden_layers=3).train()
    ids = torch.randint(1, TINY["vocab_size"], (2, 12))

    def reads(implementation, **inputs):
        model.set_attn_implementation(implementation)
        with HostReads() as counter:
            model(**inputs, labels=inputs["input_ids"]).loss.backward()
        return counter.count
    assert reads(NAME, input_ids=ids) == reads("sdpa", input_ids=ids) == 0
    positions = torch.cat([torch.arange(n) for n in (5, 7)])[None]
    packed = dict(input_ids=ids[:1], position_ids=positions)
    assert reads(NAME, **packed) == 2      # one bool() and one nonzero(), at the first layer
    with torch.inference_mode(), HostReads() as counter:   # an inference tensor keeps no version:
        model(input_ids=ids[:1], position_ids=positions.clone())    # read in every layer, and right
    assert counter.count == 3 * 2


def test_packed_rows_from_position_ids_or_cu_seq_lens():
    """The attention function finds the same sequences from position_ids restarting at 0 as from
    FlashAttention's cu_seq_lens keywords (int64 here, as torch.cumsum makes them), and attends
    each alone."""
    lengths = [6, 9, 4]
    torch.manual_seed(5)
    query = torch.randn(1, 4, sum(lengths), 16)
    key, value = (torch.randn(1, 2, sum(lengths), 16) for _ in range(2))
    module = torch.nn.Module()
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    by_positions, _ = fa_transformers.attention_forward(module, query, key, value, None,
                                                        position_ids=positions)
    by_cu, _ = fa_transformers.attention_forward(module, query, key, value, None, cu_seq_lens_q=cu,
                                                 cu_seq_lens_k=cu, position_ids=positions)
    assert torch.equal(by_positions, by_cu)
    flat = lambda t: t[0].transpose(0, 1)  # noqa: E731  (tokens, heads, D)
    expected = reference_bottom_right(flat(query), flat(key), flat(value), lengths, lengths, -1)
    torch.testing.assert_close(by_positions[0], expected, rtol=0, atol=1e-5)


def test_the_mask_is_none_without_padding():
    causal = masking_utils.causal_mask_function
    mask = torch.ones(2, 7, dtype=torch.bool)
    assert layer_mask(2, 7, 7, mask_function=causal, attention_mask=mask) is None
    mask[0, 0] = False
    assert layer_mask(2, 7, 7, mask_function=causal, attention_mask=mask).shape == (2, 7)
    # a sliding layer's cache holds the last 4 keys (positions 3 to 6), past the padding
    window = masking_utils.sliding_window_causal_mask_function(4)
    assert layer_mask(2, 1, 4, 6, 3, mask_function=window, attention_mask=mask) is None
    # a static cache of 10 entries, 7 written: its positions are on the device, the mask is 4-D
    static = layer_mask(2, 3, 10, torch.tensor(4), 0, mask_function=causal, attention_mask=mask)
    assert static.shape == (2, 1, 3, 10) and not static[..., 7:].any()


def test_options_reach_the_kernels(monkeypatch):
    """A flashattn whose ops take dropout_p and softcap gets them from the model's call, with the
    model's scaling and window (checked with stand-ins that record their keywords)."""
    seen = []

    def recording(op):
        def stand_in(*args, dropout_p=0.0, softcap=0.0, **kwargs):
            seen.append((op.__name__, dropout_p, softcap, kwargs))
            return op(*args, **kwargs)
        stand_in.__name__ = op.__name__
        return stand_in

    monkeypatch.setattr(flashattn, "attention", recording(flashattn.attention))
    monkeypatch.setattr(flashattn, "varlen_attention", recording(flashattn.varlen_attention))
    query = torch.randn(2, 4, 6, 16)
    key = value = torch.randn(2, 2, 6, 16)
    module = torch.nn.Module()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    for attention_mask, window in ((None, 3), (mask, 3), (mask, None)):
        fa_transformers.attention_forward(module, query, key, value, attention_mask, dropout=0.1,
                                          scaling=0.2, sliding_window=window, softcap=30.0)
    # padded and windowed: a key mask beside the window (packed, the window would move)
    assert [(name, p, cap, kw["scale"], kw["window_size"], kw["enable_gqa"])
            for name, p, cap, kw in seen] == [
        ("attention", 0.1, 30.0, 0.2, (2, 0), True), ("attention", 0.1, 30.0, 0.2, (2, 0), True),
        ("varlen_attention", 0.1, 30.0, 0.2, (-1, -1), True)]


def test_importing_flashattn_does_not_import_transformers():
    code = ("import sys, flashattn, flashattn.integrations\n"
            "assert 'transformers' not in sys.modules, 'flashattn imported transformers'\n"
            "sys.modules['transformers'] = None  # as if it were not installed\n"
            "try:\n"
            "    import flashattn.integrations.transformers\n"
            "except ImportError as error:\n"
            "    assert 'pip install \"flashattn[transformers]\"' in str(error), error\n"
            "else:\n"
            "    raise AssertionError('no ImportError')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_whole_sequences_keep_the_plain_causal_call(monkeypatch):
    """With as many queries as keys (training, a prompt without a cache) the call is plain causal
    attention, without causal_alignment: the Gluon kernels take only calls without modifications
    (flashattn.ops.dispatch). With a cache the alignment is bottom-right."""
    seen = []
    real = flashattn.attention
    monkeypatch.setattr(flashattn, "attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    call = fa_transformers.Call(scale=None, causal=True, window=(-1, -1), dropout=0.0, softcap=None, gqa=False)
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    call.dense(q, k, v)
    call.dense(q[:, :, 2:], k, v)
    assert "causal_alignment" not in seen[0] and seen[0]["is_causal"] is True
    assert seen[1]["causal_alignment"] == "bottom_right"


def test_an_older_transformers_is_warned_of():
    """Older releases hand caches and masks to the attention otherwise: importing the integration
    there warns, naming both versions; the releases it is tested with pass silently."""
    from flashattn.integrations import untested

    message = untested("transformers", "5.17.0", fa_transformers.OLDEST_TESTED)
    assert "5.24 or later" in message and "5.17.0" in message and 'pip install "transformers>=5.24"' in message
    assert untested("transformers", "4.57.1", (5, 24)) is not None
    for version in ("5.24.0", "5.25.0.dev0", "6.0.0", transformers.__version__):
        assert untested("transformers", version, fa_transformers.OLDEST_TESTED) is None, version
    with pytest.warns(UserWarning, match="tested with transformers 5.24 or later, and this is 5.17.0"):
        fa_transformers.warn_if_untested("transformers", "5.17.0", (5, 24))
