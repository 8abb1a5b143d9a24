"""A generation step of a Hugging Face transformers model on a left-padded batch: flashattn (through
``flashattn.integrations.transformers``) side by side with transformers' ``sdpa`` and ``eager``.

    python -m flashattn.measure.bench_generate                   # 6 prompts of 700 tokens, 4-layer Llama, bf16
    python -m flashattn.measure.bench_generate --cache static    # transformers' static cache
    python -m flashattn.measure.bench_generate --quick           # tiny, on the interpreter too

See :func:`main` for what each column measures.
"""
import argparse
import csv
import datetime
import os
import sys
import time

import torch

from .bench import DTYPES
from .variants import time_ms

FIELDS = ["gpu", "torch", "triton", "transformers", "date", "dtype", "batch", "prompt", "pads", "layers", "hidden",
          "heads", "kv_heads", "cache", "implementation", "step_ms", "generate_ms", "tokens_per_s", "of_sdpa",
          "of_eager", "in_place", "same_tokens", "command"]
IMPLEMENTATIONS = ("flashattn", "sdpa", "eager")


def left_padded_prompts(batch, length, vocab, device, seed=0):
    """``(input_ids, attention_mask, pads)``: random prompts of ``length`` positions, row ``b``
    left-padded with ``b * length // (2 * batch)`` pad tokens (0), so the rows hold from ``length``
    tokens down to a little over half of it, as a batch of prompts of mixed lengths is padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    pads = [b * length // (2 * batch) for b in range(batch)]
    mask = (torch.arange(length)[None] >= torch.tensor(pads)[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device), pads


def llama(layers, hidden, heads, kv_heads, intermediate, vocab, positions, dtype, device, seed=0):
    """A Llama of random weights (seeded) built from its configuration: nothing downloaded."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                      max_position_embeddings=positions, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def new_cache(model, kind, max_len):
    """An empty KV cache of ``kind`` ("dynamic" or "static", of ``max_len`` slots)."""
    import transformers

    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=max_len)
    return transformers.DynamicCache(config=model.config)


def cache_argument(model, cache):
    """The cache as ``model``'s forward takes it: ``cache`` in the transformers the integration is
    tested with, ``past_key_values`` in older ones (5.17 among them, which take ``cache`` as an
    unknown keyword and fill a cache of their own)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def decoding_step(model, ids, mask, kind, slots):
    """The prompt's prefill, then a function running one decoding step (one token a row, as
    generate feeds it: the mask one column longer, left padding's positions) and cropping the
    cache back, so that each call is the same step. Returns ``(step, logits of the step)``."""
    cache = new_cache(model, kind, slots)
    cached = cache_argument(model, cache)  # read once: the step below is timed
    with torch.inference_mode():   # each token at its place in its own sequence, as generate places it
        prefill = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=True, **cached)
    next_ids = prefill.logits[:, -1].argmax(-1, keepdim=True)
    step_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
    positions = (step_mask.cumsum(-1) - 1)[:, -1:]

    def step():
        with torch.inference_mode():  # the cache's tensors were made in inference mode: crop them there
            logits = model(input_ids=next_ids, attention_mask=step_mask, position_ids=positions, use_cache=True,
                           **cached).logits
            cache.crop(-1)
        return logits

    return step, step()


def in_place_calls(step):
    """How many ``flashattn.decode`` calls with ``cache_leftpad`` one call of ``step`` makes (one
    per layer where the batch decodes in place)."""
    import flashattn

    calls, decode = [], flashattn.decode

    def counting(*args, **kwargs):
        calls.append(kwargs.get("cache_leftpad") is not None)
        return decode(*args, **kwargs)

    flashattn.decode = counting
    try:
        step()
    finally:
        flashattn.decode = decode
    return sum(calls)


def one_step_ms(step, device):
    """The milliseconds of one ``step()``, waited for (a model's step, milliseconds long, is long
    enough for the host's clock)."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def profile_step(step, device, log, rows=12):
    """Log the CUDA kernels of one ``step()`` by their total time (torch.profiler), and the step's
    wall time against the time the GPU spent in kernels: a gap there is the host's."""
    from torch.profiler import ProfilerActivity, profile

    step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = one_step_ms(step, device)
    averages = prof.key_averages()
    key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    kernels_ms = sum(getattr(a, key) for a in averages) / 1e3
    log(f"wall {wall:.2f} ms (profiled), kernels {kernels_ms:.2f} ms")
    log(averages.table(sort_by=key, row_limit=rows))


def host_profile(step, log, rows=15, calls=20):
    """Log where ``calls`` calls of ``step`` spend their time on the host, by Python function
    (cProfile, each function's own time: it slows every call alike, so read the shares)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    log(f"host, {calls} steps under cProfile:" + text.getvalue().split("\n\n", 1)[-1].rstrip())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate_ms(model, ids, mask, kind, new, rounds):
    """ms per new token of ``model.generate`` (greedy, exactly ``new`` tokens), its prefill taken
    out: (time of 1 + new tokens - time of 1 token) / new, best of ``rounds``. Returns ``(ms,
    tokens)``, the tokens of the longer run."""
    options = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None,
                   cache_implementation=kind if kind == "static" else None, disable_compile=True)
    best, tokens = {}, None
    for count in (1, 1 + new):
        for _ in range(rounds):
            synchronize(ids.device)
            start = time.perf_counter()
            out = model.generate(input_ids=ids, max_new_tokens=count, min_new_tokens=count, **options)
            synchronize(ids.device)
            best[count] = min(best.get(count, float("inf")), time.perf_counter() - start)
        tokens = out
    return (best[1 + new] - best[1]) / new * 1e3, tokens


def run(args, log=print):
    """Time each implementation on the same model and prompts; return the rows."""
    import transformers
    import triton

    import flashattn
    from flashattn.integrations import transformers as fa_transformers

    device, dtype = flashattn.DEVICE, DTYPES[args.dtype]
    names = {"flashattn": fa_transformers.register(), "sdpa": "sdpa", "eager": "eager"}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    model = llama(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                  args.prompt + args.new + 2, dtype, device)
    ids, mask, pads = left_padded_prompts(args.batch, args.prompt, args.vocab, device)
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                date=datetime.date.today().isoformat(), dtype=args.dtype, batch=args.batch, prompt=args.prompt,
                pads=" ".join(map(str, pads)), layers=args.layers, hidden=args.hidden, heads=args.heads,
                kv_heads=args.kv_heads, cache=args.cache,
                command=" ".join(["python -m flashattn.measure.bench_generate", *args.argv]))
    measured, tokens = {}, {}
    for implementation in IMPLEMENTATIONS:
        model.set_attn_implementation(names[implementation])
        step, _ = decoding_step(model, ids, mask, args.cache, args.prompt + args.new + 1)
        placed = in_place_calls(step) if implementation == "flashattn" else ""
        if args.profile:
            log(f"{implementation}: one step under torch.profiler")
            profile_step(step, device, log, rows=args.profile_rows)
            host_profile(step, log, rows=args.profile_rows)
        step_ms = time_ms(step, args.quick)
        gen_ms, tokens[implementation] = generate_ms(model, ids, mask, args.cache, args.new, 1 if args.quick else 3)
        measured[implementation] = (step_ms, gen_ms, placed)
        log(f"{implementation:10} step {step_ms:9.3f} ms   generate {gen_ms:9.3f} ms a token"
            + (f"   ({placed} of {args.layers} layers decode in place)" if placed != "" else ""))
    rows = []
    for implementation, (step_ms, gen_ms, placed) in measured.items():
        same = torch.equal(tokens[implementation], tokens["sdpa"])
        rows.append(dict(meta, implementation=implementation, step_ms=f"{step_ms:.4f}", generate_ms=f"{gen_ms:.4f}",
                         tokens_per_s=f"{args.batch / gen_ms * 1e3:.1f}",
                         of_sdpa=f"{step_ms / measured['sdpa'][0]:.3f}",
                         of_eager=f"{step_ms / measured['eager'][0]:.3f}",
                         in_place=placed, same_tokens="yes" if same else "no"))
    return rows


def summary(rows):
    """The implementations side by side: a step's ms, generate's ms and tokens/s, the ratios."""
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, transformers "
             f"{first['transformers']}, {first['date']}: {first['layers']}-layer Llama (hidden {first['hidden']}, "
             f"{first['heads']}/{first['kv_heads']} heads), {first['dtype']}, {first['batch']} prompts of "
             f"{first['prompt']} positions left-padded by {first['pads']}, {first['cache']} cache",
             f"{'':10} {'step ms':>9} {'x sdpa':>7} {'x eager':>7} {'generate ms':>11} {'tokens/s':>9} "
             f"{'in place':>8} {'tokens = sdpa':>13}"]
    for r in rows:
        lines.append(f"{r['implementation']:10} {float(r['step_ms']):9.3f} {float(r['of_sdpa']):7.2f} "
                     f"{float(r['of_eager']):7.2f} {float(r['generate_ms']):11.3f} {float(r['tokens_per_s']):9.1f} "
                     f"{str(r['in_place']):>8} {r['same_tokens']:>13}")
    return lines


def require_transformers(module):
    """Exit with how to install Hugging Face transformers where ``module``'s benchmark lacks it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit(f'{module} needs Hugging Face transformers: pip install "flashattn[transformers]"')


def write_rows(out, fields, rows):
    """The rows as the CSV ``out`` (its folder made), with ``fields`` as columns."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print("wrote", out)


def main(argv=None):
    """``python -m flashattn.measure.bench_generate``: greedy generation on a left-padded batch of
    ``--batch`` prompts of ``--prompt`` positions (row b padded by b x prompt / (2 x batch) tokens),
    a Llama of random weights (``--layers``, ``--hidden``, ...), with each attention implementation
    of transformers: ``flashattn`` (flashattn.integrations.transformers: the batch decodes in place,
    ``flashattn.decode`` with ``cache_leftpad``), ``sdpa`` and ``eager``. Columns:

    * ``step_ms``: one decoding step, the model's forward for one new token a row on the prompt's
      cache (the cache cropped back after each, so that every call is the same step): triton's
      do_bench median on a GPU (kernels and whatever host work keeps them waiting);
    * ``generate_ms``: ``model.generate``'s time per new token, its prefill taken out ((time of
      1 + new tokens - time of 1) / new, best of 3), everything generate does in a step included;
      ``tokens_per_s``: the batch's new tokens per second at that rate;
    * ``of_sdpa``, ``of_eager``: step_ms against theirs; ``in_place``: the layers whose step called
      decode with cache_leftpad; ``same_tokens``: whether greedy generation gave sdpa's tokens
      (bf16 roundings may part them after a while).

    ``--profile``: before each implementation's timings, one step under torch's profiler (its
    operators by their time on the device, and the step's wall time against the kernels' total: a
    step short on the device and long on the wall waits for the host), then 20 steps under
    cProfile, the Python functions by their own time: where the host's time goes (the mask
    function, the attention call, the cache, Triton's launches).

    ``--quick``: a tiny float32 model, 3 prompts of 12 positions, 2 new tokens (runs on the
    interpreter; its times mean nothing).
    """
    p = argparse.ArgumentParser(prog="python -m flashattn.measure.bench_generate", description=main.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--prompt", type=int, default=700)
    p.add_argument("--new", type=int, default=32, help="new tokens of the generate timing")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--quick", action="store_true", help="tiny sizes, float32 (the interpreter too)")
    p.add_argument("--profile", action="store_true", help="each implementation's step under torch.profiler first")
    p.add_argument("--profile-rows", type=int, default=15, help="operators in each profile's table")
    p.add_argument("--out", help="the CSV (default figures/data/generate_left_padded.csv)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    require_transformers("flashattn.measure.bench_generate")
    if args.quick:
        args.batch, args.prompt, args.new, args.layers, args.hidden = 3, 12, 2, 2, 64
        args.heads, args.kv_heads, args.intermediate, args.vocab, args.dtype = 4, 2, 128, 128, "fp32"
    elif not torch.cuda.is_available():
        sys.exit("flashattn.measure.bench_generate times on a CUDA GPU; on a CPU add --quick")
    out = args.out or os.path.join("figures", "data", "generate_left_padded.csv")
    rows = run(args)
    print("\n".join(summary(rows)))
    write_rows(out, FIELDS, rows)


if __name__ == "__main__":
    main()
