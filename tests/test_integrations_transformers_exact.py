"""flashattn.integrations.transformers against transformers' own attention, family by family: every
pattern a model's mask function describes is computed exactly (static caches, chunked attention,
bidirectional windows and overlays), and a model compiles with ``fullgraph=True``.

Tiny random-weight models built from their configs (nothing downloaded), float32, against ``sdpa``
(``eager`` where transformers refuses SDPA) on the same weights: greedy tokens identical, logits
within a few float32 roundings of theirs (the two differ only in the order of the sums).
"""
import pytest
import torch

import flashattn

from test_integrations_transformers import on_the_kernels_device  # noqa: F401  (autouse)
from test_integrations_transformers import NAME, TINY, layer_mask, padded_batch, tiny

transformers = pytest.importorskip("transformers")
fa_transformers = pytest.importorskip("flashattn.integrations.transformers")
from transformers import masking_utils  # noqa: E402  (after the skips above)

ATOL = 2e-5   # logits of order 1: float32 sums in another order (measured: up to 3e-7)


def generated(model, implementation, ids, mask=None, new=5, **options):
    """Greedy tokens and each step's logits of ``model.generate`` with ``implementation``. On a GPU
    transformers compiles a static cache's steps unless told not to: here only where the test asks
    (``compile_config``)."""
    model.set_attn_implementation(implementation)
    options.setdefault("disable_compile", "compile_config" not in options)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.logits)


def assert_same_generation(model, baseline, ids, mask=None, **options):
    tokens, steps = generated(model, NAME, ids, mask, **options)
    their_tokens, their_steps = generated(model, baseline, ids, mask, **options)
    assert torch.equal(tokens, their_tokens), (tokens[:, ids.shape[1]:], their_tokens[:, ids.shape[1]:])
    torch.testing.assert_close(steps, their_steps, rtol=0, atol=ATOL)


def hidden(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_same_tokens(model, baseline, mask=None, **inputs):
    """The model's outputs at the tokens (not the padding) with flashattn and with ``baseline``."""
    ours, theirs = hidden(model, NAME, attention_mask=mask, **inputs), \
        hidden(model, baseline, attention_mask=mask, **inputs)
    tokens = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(ours[tokens], theirs[tokens], rtol=0, atol=ATOL)


# -- Static caches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, side, window", [
    ("llama", "none", None), ("llama", "left", None),
    ("mistral", "none", 16),      # the prompt (12) and the whole generation (17) inside the window
    ("mistral", "left", 5),       # the window slides: the sliding layers' static cache rolls
    ("gemma2", "none", 16),       # full and sliding layers, softcapping; against eager
])
def test_a_static_cache_attends_only_its_written_slots(family, side, window):
    """``cache_implementation="static"``: the cache holds ``max_cache_len`` slots, most not yet
    written, and its queries' positions are a tensor; the keys a query sees are those transformers'
    own mask keeps, with or without padding (before, no padding meant every slot, zeros included)."""
    model = tiny(family, **({} if window is None else dict(sliding_window=window)))
    ids, mask = padded_batch("left", batch=2)
    assert_same_generation(model, "eager" if family == "gemma2" else "sdpa", ids,
                           None if side == "none" else mask, cache_implementation="static")


# -- Chunked attention (Llama 4) ---------------------------------------------------------------------

def tiny_llama4(chunk=5):
    """A Llama 4 text model whose second layer attends in chunks of ``chunk`` positions."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        **{**TINY, "max_position_embeddings": 64}, intermediate_size_mlp=128, head_dim=16, attention_chunk_size=chunk,
        num_local_experts=2, num_experts_per_tok=1, no_rope_layers=[0, 1], interleave_moe_layer_step=2)
    assert config.layer_types == ["full_attention", "chunked_attention"]
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.mark.parametrize("side", ["none", "left"])
def test_chunked_attention_of_llama4(side):
    """Llama 4's chunked layers see only their chunk of ``attention_chunk_size`` positions (from
    each row's first token): 12-token prompts in chunks of 5, then generation across a boundary."""
    model = tiny_llama4()
    ids, mask = padded_batch("left", batch=2)
    mask = None if side == "none" else mask
    assert_same_tokens(model, "sdpa", mask=mask, input_ids=ids)
    # the chunks matter here: the same model without them gives other logits
    unchunked = hidden(tiny_llama4(chunk=64), NAME, input_ids=ids, attention_mask=mask)
    assert (unchunked - hidden(model, "sdpa", input_ids=ids, attention_mask=mask)).abs().max() > 1e-2
    assert_same_generation(model, "sdpa", ids[:, :7], None if mask is None else mask[:, :7])


def test_chunks_holding_every_position_are_plain_causal_attention():
    """While every position is in the first chunk the kernels mask causally themselves (no 4-D
    mask); past it the mask function gives transformers' 4-D mask."""
    chunked = masking_utils.chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.int64))
    assert layer_mask(2, 3, 8, 5, 0, mask_function=chunked) is None
    mask = layer_mask(2, 3, 9, 6, 0, mask_function=chunked)
    expected = masking_utils.sdpa_mask(2, 3, 9, 6, 0, mask_function=chunked, allow_is_causal_skip=False,
                                       device=flashattn.DEVICE)
    assert torch.equal(mask, expected)


# -- Bidirectional windows, overlays ----------------------------------------------------------------

def tiny_modernbert():
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=64, local_attention=6, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    assert config.layer_types == ["full_attention", "sliding_attention"] and config.sliding_window == 3
    return transformers.ModernBertModel(config).eval()


@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_modernbert_local_attention(side):
    """ModernBERT's local layers keep |i - j| <= 3 (half its window of 6), passing the layers
    sliding_window=4, as transformers' FlashAttention path reads it; padded, the window counts
    places in the padded row, as its mask does."""
    model = tiny_modernbert()
    ids, mask = padded_batch(side if side != "none" else "left")
    assert_same_tokens(model, "sdpa", mask=None if side == "none" else mask, input_ids=ids)


def test_gemma3_bidirectional_overlay():
    """Gemma 3 with ``use_bidirectional_attention``: its sliding layers' pattern is an
    ``or_mask_function`` overlay on the causal window, which the kernels cannot place: computed from
    transformers' own mask."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                           use_bidirectional_attention=True)
    model = transformers.Gemma3ForCausalLM(config).eval()
    ids, mask = padded_batch("right")
    assert_same_tokens(model, "sdpa", input_ids=ids)
    assert_same_tokens(model, "sdpa", mask=mask, input_ids=ids)


@pytest.mark.parametrize("overlay", ["and", "or", "blocks"])
def test_overlays_are_transformers_own_masks(overlay):
    """Any ``and_mask_function``/``or_mask_function``/``block_sequence_ids`` reaching the mask
    function: its 4-D mask is the one SDPA gets, pair for pair, and the model's output with it
    is SDPA's."""
    model = tiny("llama")
    ids, mask = padded_batch("left")
    config = model.config
    options = {"and": dict(and_mask_function=lambda b, h, q, kv: (q - kv) % 3 != 1),
               "or": dict(or_mask_function=lambda b, h, q, kv: kv < 2),
               "blocks": dict(block_sequence_ids=torch.tensor([[-1] * 4 + [0] * 4 + [-1] * 4] * 3))}[overlay]
    embeds = torch.zeros(3, 12, 8)
    masks = {}
    for implementation in (NAME, "sdpa"):
        config._attn_implementation = implementation
        masks[implementation] = masking_utils.create_causal_mask(config, embeds, mask.bool(), None, **options)
    assert masks[NAME].shape == (3, 1, 12, 12) and torch.equal(masks[NAME], masks["sdpa"])
    # through the attention function with the layers' own call
    query = torch.randn(3, 4, 12, 16)
    key, value = torch.randn(3, 2, 12, 16), torch.randn(3, 2, 12, 16)
    out, _ = fa_transformers.attention_forward(model.model.layers[0].self_attn, query, key, value, masks[NAME])
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, masks["sdpa"], enable_gqa=True)
    rows = masks["sdpa"].any(-1)[:, 0]   # rows that see some key (SDPA gives the others NaN)
    torch.testing.assert_close(out[rows], expected.transpose(1, 2)[rows], rtol=0, atol=2e-6)


# -- Attention sinks (GPT-OSS) -----------------------------------------------------------------------

def gpt_oss():
    """A tiny GPT-OSS: grouped heads, a window of 5 on every other layer, two experts, and sinks of
    logits -2 to 3, large enough to take a visible share of every row's softmax."""
    config = transformers.GptOssConfig(**TINY, head_dim=16, sliding_window=5, num_local_experts=2,
                                       num_experts_per_tok=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(-2.0, 3.0)
    return model


def test_attention_sinks_of_gpt_oss():
    """Each head's sink logit joins the softmax of every row: the output is rescaled from the
    kernels' ``(out, lse)``. Logits padded and not, greedy generation from a left-padded batch (its
    decoding steps in place) as eager's (transformers has no SDPA path for sinks), and the
    gradients of every parameter, the sinks included, as eager's."""
    model = gpt_oss()
    ids, mask = padded_batch("left")
    assert_same_tokens(model, "eager", input_ids=ids)
    assert_same_tokens(model, "eager", mask, input_ids=ids)
    assert_same_generation(model, "eager", ids, mask, new=3)
    labels = ids.masked_fill(mask == 0, -100)

    def grads(m, implementation):
        m.train().set_attn_implementation(implementation)
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        sinks = torch.cat([layer.self_attn.sinks.grad for layer in m.model.layers])
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]), sinks

    (ours, ours_sinks), (theirs, theirs_sinks) = grads(model, NAME), grads(model, "eager")
    # GPT-OSS's experts multiply in float32 at most (no float64 model to hold both to the rule):
    # the two float32 computations agree to a few roundings of the largest gradient
    for what, a, b in (("gradients", ours, theirs), ("the sinks' gradients", ours_sinks, theirs_sinks)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"{what}: {(a - b).abs().max():.2e} off"
    assert theirs_sinks.abs().min() > 0, "every sink takes part"


# -- Encoders and encoder-decoders -------------------------------------------------------------------

@pytest.mark.parametrize("side", ["none", "right"])
def test_bert(side):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    ids, mask = padded_batch("right")
    assert_same_tokens(model, "sdpa", mask=None if side == "none" else mask, input_ids=ids)


def test_bart_generation():
    """BART: a padded encoder, the decoder's causal self-attention with its cache and its
    cross-attention to the encoder (N_q != N_k, not causal, the encoder's padding)."""
    torch.manual_seed(0)
    config = transformers.BartConfig(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=64)
    model = transformers.BartForConditionalGeneration(config).eval()
    ids, mask = padded_batch("right", batch=2)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5])   # the decoder's unpadded
    torch.testing.assert_close(hidden(model, NAME, **inputs), hidden(model, "sdpa", **inputs), rtol=0, atol=ATOL)
    assert_same_generation(model, "sdpa", ids, mask)


# -- torch.compile -----------------------------------------------------------------------------------

def counting_backend(graphs):
    """A torch.compile backend that appends each graph it gets to ``graphs`` and runs it with
    aot_eager (the operators run as in eager, traced through AOTAutograd with their fake
    implementations). A function, not an object: transformers deep-copies its compile config."""
    def backend(graph, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        graphs.append(graph)
        return aot_eager(graph, example_inputs)
    return backend


@pytest.mark.parametrize("family", ["llama", pytest.param("mistral", marks=pytest.mark.slow),
                                    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_a_model_compiles_in_one_graph_forward_and_backward(family):
    """``torch.compile(model, fullgraph=True)``: one graph, padded and not, forward and backward,
    the same loss and gradients as eager (nothing is read on the host in the call path; GPT-OSS:
    its attention sinks too)."""
    # one layer where it can be: tracing takes the time (GPT-OSS's two hold a window and no window)
    model = (gpt_oss() if family == "gpt_oss" else tiny(family, num_hidden_layers=1)).train()
    ids, mask = padded_batch("left")
    model.set_attn_implementation(NAME)
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
        labels = ids if "attention_mask" not in inputs else ids.masked_fill(mask == 0, -100)
        results = []
        for compiled in (True, False):
            torch._dynamo.reset()
            graphs = []
            run = torch.compile(model, fullgraph=True, backend=counting_backend(graphs)) if compiled else model
            model.zero_grad()
            out = run(**inputs, labels=labels, use_cache=False)
            out.loss.backward()
            results.append((out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
            assert len(graphs) == (1 if compiled else 0)
        (logits, grads), (logits_e, grads_e) = results
        torch.testing.assert_close(logits, logits_e, rtol=0, atol=2e-6)
        for g, g_e in zip(grads, grads_e):
            torch.testing.assert_close(g, g_e, rtol=0, atol=2e-6)


@pytest.mark.parametrize("family, side", [("llama", "left"), ("mistral", "none")])
def test_compiled_generation_with_a_static_cache(family, side):
    """generate with ``cache_implementation="static"`` and its forward compiled with
    ``fullgraph=True`` (transformers compiles the decoding steps): SDPA's tokens and logits."""
    model = tiny(family)
    ids, mask = padded_batch("left", batch=2)
    graphs = []
    config = transformers.CompileConfig(fullgraph=True, backend=counting_backend(graphs), mode=None)
    config._compile_all_devices = True   # transformers compiles on GPUs only, unless asked
    torch._dynamo.reset()
    tokens, steps = generated(model, NAME, ids, None if side == "none" else mask, cache_implementation="static",
                              compile_config=config)
    assert graphs, "the decoding steps were not compiled"
    their_tokens, their_steps = generated(model, "sdpa", ids, None if side == "none" else mask,
                                          cache_implementation="static", disable_compile=True)
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(steps, their_steps, rtol=0, atol=ATOL)


def test_what_it_cannot_compute_is_refused_by_name():
    """A learned bias (T5's ``position_bias``) and a padding mask that does not cover the layer's
    keys are refused, naming them, rather than dropped or guessed."""
    module = torch.nn.Module()
    query = torch.randn(1, 2, 4, 16)
    key = value = torch.randn(1, 2, 6, 16)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fa_transformers.attention_forward(module, query, key, value, None, position_bias=torch.zeros(1, 2, 4, 6))
    with pytest.raises(ValueError, match="padding mask has 5 columns but the layer holds 6 keys"):
        fa_transformers.attention_forward(module, query, key, value, torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"s_aux \(the attention sinks\) has shape \(3,\); expected .* \(2,\)"):
        fa_transformers.attention_forward(module, query, key, value, None, s_aux=torch.zeros(3))
