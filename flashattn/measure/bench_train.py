"""A training step of a Llama-shaped Hugging Face transformers model: flashattn (through
``flashattn.integrations.transformers``) side by side with transformers' ``sdpa``.

    python -m flashattn.measure.bench_train            # 8 layers, hidden 2048, 16/4 heads, 4 x 4096 tokens, bf16
    python -m flashattn.measure.bench_train --quick    # tiny, on the interpreter too

See :func:`main` for what each column measures.
"""
import argparse
import datetime
import json
import os
import sys

import torch

from .bench import DTYPES, interleaved_ms
from .bench_generate import llama, one_step_ms, profile_step, require_transformers, write_rows

FIELDS = ["gpu", "torch", "triton", "transformers", "date", "dtype", "batch", "tokens", "layers", "hidden", "heads",
          "kv_heads", "implementation", "step_ms", "tokens_per_s", "of_sdpa", "loss", "loss_diff", "grad_diff",
          "command"]
#: (row name, attention implementation, deterministic algorithms on)
IMPLEMENTATIONS = (("flashattn", "flashattn", False), ("flashattn-deterministic", "flashattn", True),
                   ("sdpa", "sdpa", False))


def training_step(model, ids):
    """A function running one training step on ``ids`` (the labels too): the forward, the loss,
    the backward; the gradients are set to None first, as an optimizer's ``zero_grad`` does."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return step


def gradients(model):
    """The parameters' gradients, by name (float32 copies)."""
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


def run(args, log=print):
    """Time each implementation's step on the same model and tokens; return the rows."""
    import transformers
    import triton

    import flashattn
    from flashattn.integrations import transformers as fa_transformers

    device, dtype = flashattn.DEVICE, DTYPES[args.dtype]
    names = {"flashattn": fa_transformers.register(), "sdpa": "sdpa"}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    model = llama(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                  args.tokens, dtype, device).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                date=datetime.date.today().isoformat(), dtype=args.dtype, batch=args.batch, tokens=args.tokens,
                layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                command=" ".join(["python -m flashattn.measure.bench_train", *args.argv]))
    step = training_step(model, ids)

    def run_with(implementation, deterministic):
        def run():  # one step with this implementation, deterministic algorithms on or off
            model.set_attn_implementation(names[implementation])
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            return step()
        return run
    runs = {row: run_with(implementation, deterministic) for row, implementation, deterministic in IMPLEMENTATIONS}
    was = torch.are_deterministic_algorithms_enabled()
    measured = {}
    try:
        for row, run in runs.items():  # the first step's loss and gradients
            loss = run().item()
            measured[row] = (loss, gradients(model))
            if args.profile:
                log(f"== {row}")
                profile_step(run, device, log)
        for run in runs.values():
            for _ in range(1 if args.quick else 3):
                run()
        ms = interleaved_ms(runs, 1 if args.quick else args.rounds, timer=lambda fn: one_step_ms(fn, device))
    finally:
        torch.use_deterministic_algorithms(was)
    for row, (loss, _) in measured.items():
        log(f"{row:24} step {ms[row]:9.2f} ms   {args.batch * args.tokens / ms[row] * 1e3:10.0f} tokens/s   "
            f"loss {loss:.5f}")
    rows = []
    sdpa_ms, (sdpa_loss, sdpa_grads) = ms["sdpa"], measured["sdpa"]
    for row, (loss, grads) in measured.items():
        # the largest difference of a parameter's gradient from sdpa's, relative to that gradient's largest entry
        grad_diff = max(((g - sdpa_grads[n]).abs().max() / sdpa_grads[n].abs().max().clamp_min(1e-30)).item()
                        for n, g in grads.items())
        rows.append(dict(meta, implementation=row, step_ms=f"{ms[row]:.3f}",
                         tokens_per_s=f"{args.batch * args.tokens / ms[row] * 1e3:.0f}",
                         of_sdpa=f"{sdpa_ms / ms[row]:.3f}",
                         loss=f"{loss:.6f}", loss_diff=f"{abs(loss - sdpa_loss):.3g}", grad_diff=f"{grad_diff:.3g}"))
    return rows


def summary(rows):
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, transformers "
             f"{first['transformers']}, {first['date']}: {first['layers']}-layer Llama (hidden {first['hidden']}, "
             f"{first['heads']}/{first['kv_heads']} heads), {first['dtype']}, {first['batch']} x {first['tokens']} "
             "tokens, forward + loss + backward",
             f"{'':24} {'step ms':>9} {'tokens/s':>10} {'x sdpa':>7} {'loss diff':>10} {'grad diff':>10}"]
    for r in rows:
        lines.append(f"{r['implementation']:24} {float(r['step_ms']):9.2f} {float(r['tokens_per_s']):10.0f} "
                     f"{float(r['of_sdpa']):7.3f} {float(r['loss_diff']):10.3g} {float(r['grad_diff']):10.3g}")
    return lines


def config_entry(text):
    """``KEY=VALUE`` as ``(KEY, VALUE)``, the value read as JSON (``HEAD_SPLIT=4``, ``PREFETCH=false``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, json.loads(value)


def main(argv=None):
    """``python -m flashattn.measure.bench_train``: a training step (forward, the language model's
    loss, backward; no optimizer) of a Llama of random weights on random tokens, with each attention
    implementation of transformers: ``flashattn`` (flashattn.integrations.transformers, the default
    backward), ``flashattn-deterministic`` (the same under ``torch.use_deterministic_algorithms``,
    which makes flashattn's backward bit-identical from run to run; other operations are asked for
    their deterministic versions too, warnings only) and ``sdpa``. Columns:

    * ``step_ms``: the median of ``--rounds`` steps after 3 unmeasured ones, each waited for, the
      implementations taking turns step by step;
      ``tokens_per_s``: the batch's tokens per second at that rate; ``of_sdpa``: sdpa's time over
      this row's (above 1: faster than sdpa);
    * ``loss_diff``: the first step's loss against sdpa's; ``grad_diff``: the largest difference of
      a parameter's gradient from sdpa's, relative to that gradient's largest entry.

    ``--quick``: a tiny float32 model, 2 sequences of 16 tokens (runs on the interpreter; its times
    mean nothing). ``--profile``: before the timings, each implementation's step under torch's
    profiler: its kernels by total time, and its wall time against the kernels' (the difference is
    time the GPU waited for the host).
    """
    p = argparse.ArgumentParser(prog="python -m flashattn.measure.bench_train", description=main.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="tiny sizes, float32 (the interpreter too)")
    p.add_argument("--profile", action="store_true", help="each step's kernels under torch.profiler first")
    p.add_argument("--out", help="the CSV (default figures/data/train_step.csv)")
    p.add_argument("--fused-config", nargs="+", type=config_entry, default=[], metavar="KEY=VALUE",
                   help="entries set in every configuration of the fused Gluon backward "
                        "(hopper.backward.DQ_CONFIGS), e.g. HEAD_SPLIT=4")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    require_transformers("flashattn.measure.bench_train")
    if args.quick:
        args.batch, args.tokens, args.layers, args.hidden = 2, 16, 2, 64
        args.heads, args.kv_heads, args.intermediate, args.vocab, args.dtype = 4, 2, 128, 128, "fp32"
    elif not torch.cuda.is_available():
        sys.exit("flashattn.measure.bench_train times on a CUDA GPU; on a CPU add --quick")
    if args.fused_config:
        from .. import hopper
        fused = hopper.load("backward")
        if fused is None:
            sys.exit("--fused-config: this GPU or Triton has no Gluon backward")
        for cfg in fused.DQ_CONFIGS.values():
            cfg.update(dict(args.fused_config))
    out = args.out or os.path.join("figures", "data", "train_step.csv")
    rows = run(args)
    print("\n".join(summary(rows)))
    write_rows(out, FIELDS, rows)


if __name__ == "__main__":
    main()
