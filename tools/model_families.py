"""Tiny random models of many Hugging Face transformers families on flashattn, each checked against
the library's own attention, in float32, on any machine.

    python tools/model_families.py                  # every family of FAMILIES
    python tools/model_families.py qwen2 phi3       # some of them
    python tools/model_families.py --no-generate    # the logits only (faster)

For each family a model of two layers is built from its configuration (random weights, seeded:
nothing is downloaded) and run with ``flashattn.integrations.transformers`` and with transformers'
``sdpa`` (``eager`` where transformers refuses sdpa for the family): the logits of a batch without
padding and left-padded, then greedy generation from the padded batch with the dynamic and the
static cache. A family passes when the logits agree within ``TOLERANCE`` and the greedy tokens are
the same. A family the integration refuses (with an error naming what it lacks) is reported as
refused; one the installed transformers does not know or cannot build from these settings, as
skipped. The exit status is 1 when a family fails. ``tests/test_model_families.py`` runs a few.
"""
import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's flashattn

import torch  # noqa: E402

#: What every family's configuration gets: two layers of 4 query heads on 2 key/value heads of
#: head dim 16, so that grouped heads are exercised wherever a family has them.
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64, pad_token_id=0)
#: Each family and what its configuration changes from BASE (None removes a key): windows shorter
#: than the prompts, partial rotary embeddings, experts, MLA's value head dim, the softcaps.
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=5),
    "mixtral": dict(sliding_window=5, num_local_experts=2, num_experts_per_tok=1),
    "qwen2": dict(sliding_window=5, use_sliding_window=True, max_window_layers=1),  # a window on layer 2 only
    "qwen2_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3": {},
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": {},
    "gemma": {},
    "gemma2": dict(sliding_window=5, query_pre_attn_scalar=16),  # softcaps on the scores and logits
    "gemma3_text": dict(sliding_window=5, query_pre_attn_scalar=16),
    "cohere": {},
    "olmo": {},
    "olmo2": {},
    "starcoder2": dict(sliding_window=5),
    "gpt_neox": dict(rotary_pct=0.5),
    "stablelm": dict(partial_rotary_factor=0.5),
    "granite": {},
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "glm4": {},
    "helium": {},
    "smollm3": {},
    "exaone4": dict(sliding_window=5),
    "seed_oss": {},
    "ernie4_5": {},
    # multi-head latent attention: queries and keys of head dim 24, values of 8
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                        head_dim=8, num_key_value_heads=4, n_routed_experts=2, num_experts_per_tok=1,
                        moe_intermediate_size=32, first_k_dense_replace=2, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=5),  # attention sinks
}
#: Logits may differ from the reference's by float32 roundings (a few 1e-7 at these sizes).
TOLERANCE = 2e-5
NEW_TOKENS = 8


def build(family):
    """The family's tiny model in float32, eval mode; raises what transformers raises."""
    import transformers

    settings = {key: value for key, value in {**BASE, **FAMILIES[family]}.items() if value is not None}
    config = transformers.AutoConfig.for_model(family, **settings)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def batch(device):
    """``(input_ids, attention_mask)``: 3 prompts of 14 positions, rows 2 and 3 left-padded by 3 and
    7 (longer than the families' windows of 5, so that the windows slide)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, BASE["vocab_size"], (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :3], mask[2, :7] = 0, 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def reference_of(model):
    """``sdpa``, or ``eager`` where transformers refuses sdpa for the model."""
    try:
        model.set_attn_implementation("sdpa")
        return "sdpa"
    except (ValueError, NotImplementedError):
        return "eager"


def runs(model, name, ids, mask, generate):
    """What the model computes with attention ``name``: the logits without padding and padded (those
    of padding positions zeroed: no implementation defines them), then for each cache the greedy
    tokens and the logits of each new token."""
    model.set_attn_implementation(name)
    out = {}
    with torch.no_grad():
        out["unpadded"] = model(input_ids=ids).logits
        out["padded"] = model(input_ids=ids, attention_mask=mask).logits * mask[..., None]
    for cache in ("dynamic", "static") if generate else ():
        result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
                                output_logits=True, return_dict_in_generate=True,
                                cache_implementation="static" if cache == "static" else None)
        out[cache] = (result.sequences, torch.stack(result.logits))
    return out


def check(family, generate=True):
    """One family, checked: a dict with ``family``, ``reference``, ``status`` ("pass", "FAIL",
    "refused", "skipped"), ``detail`` and the largest logit difference of each run."""
    from flashattn.integrations import transformers as fa_transformers

    row = dict(family=family, reference="", status="", detail="")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(family)
    except Exception as error:  # a family this transformers lacks or cannot build so
        return dict(row, status="skipped", detail=f"{type(error).__name__}: {error}".splitlines()[0][:120])
    import flashattn

    model = model.to(flashattn.DEVICE)
    ids, mask = batch(flashattn.DEVICE)
    row["reference"] = reference = reference_of(model)
    try:
        ours = runs(model, fa_transformers.register(), ids, mask, generate)
    except NotImplementedError as error:  # a feature the integration refuses by name
        return dict(row, status="refused", detail=str(error).splitlines()[0][:120])
    theirs = runs(model, reference, ids, mask, generate)
    failures = []
    for run, value in ours.items():
        if isinstance(value, tuple):
            (tokens, logits), (tokens_ref, logits_ref) = value, theirs[run]
            if not torch.equal(tokens, tokens_ref):
                failures.append(f"{run}: other tokens")
        else:
            logits, logits_ref = value, theirs[run]
        row[run] = diff = (logits - logits_ref).abs().max().item()
        if not diff <= TOLERANCE:
            failures.append(f"{run}: logits {diff:.1e} off")
    return dict(row, status="FAIL" if failures else "pass", detail="; ".join(failures))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", help=f"some of: {' '.join(FAMILIES)}")
    p.add_argument("--no-generate", action="store_true", help="the logits only, no generation")
    args = p.parse_args(argv)
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; expected some of {sorted(FAMILIES)}")
    import transformers

    import flashattn

    transformers.logging.set_verbosity_error()  # the tiny configurations' notes
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, on {flashattn.DEVICE}; largest "
          f"logit difference from the reference (float32), greedy tokens compared")
    runs_shown = ("unpadded", "padded") + (() if args.no_generate else ("dynamic", "static"))
    print(f"{'family':12} {'reference':9} " + " ".join(f"{run:>9}" for run in runs_shown) + "  status")
    failed = False
    for family in args.families or FAMILIES:
        row = check(family, generate=not args.no_generate)
        failed |= row["status"] == "FAIL"
        cells = " ".join(f"{row[run]:9.1e}" if run in row else f"{'':9}" for run in runs_shown)
        print(f"{family:12} {row['reference']:9} {cells}  {row['status']}"
              + (f": {row['detail']}" if row["detail"] else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
