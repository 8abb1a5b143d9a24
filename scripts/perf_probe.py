"""Where does the time go? One GPU run that times every tile configuration of every kernel at a
few reference settings, next to SDPA's backends, and prints tables (used to write
notes/performance.md; the full sweep is `python -m flashattn.bench`).

    python scripts/perf_probe.py [--settings bf16:128:1:8192 ...] [--tma]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import flashattn  # noqa: E402
from flashattn import bench, tuning  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}


def config_table(seq_len):
    """The autotuner's timings of every candidate, per kernel, fastest first."""
    bucket = tuning.seq_bucket(seq_len)
    for (name, b), tuner in sorted(tuning._tuners.items()):
        if b != bucket or not getattr(tuner, "configs_timings", None):
            continue
        timings = sorted(tuner.configs_timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1])
        print(f"  {name}: {len(timings)} candidates timed")
        for config, t in timings[:6]:
            ms = t[0] if isinstance(t, list) else t
            print(f"    {ms:8.3f} ms  {config}")
        tuner.configs_timings = None


def probe(dtype, head_dim, causal, n, tokens, providers, tma):
    heads = max(tokens // n, 1)
    label = f"{dtype} D={head_dim} causal={causal} N={n} heads={heads}"
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    print(f"\n== {label}", flush=True)
    for provider in providers:
        try:
            res, peak = bench.measure(provider, DTYPES[dtype], 1, heads, n, head_dim, bool(causal))
        except Exception as e:
            print(f"  {provider:15} skipped: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            continue
        print(f"  {provider:15} fwd {res['fwd'][1]:6.1f} TFLOPS ({res['fwd'][0]:7.3f} ms)  "
              f"bwd {res['bwd'][1]:6.1f} TFLOPS ({res['bwd'][0]:7.3f} ms)  peak {peak:7.0f} MiB", flush=True)
        if provider == "flashattn":
            config_table(n)
    if tma and dtype in ("fp16", "bf16") and head_dim == 128:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "notes", "experiments"))
        from fwd_tma import forward_tma
        q, k, v = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
        flops = bench.attention_flops(1, heads, n, n, head_dim, bool(causal), "fwd")
        for bq, bkv, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)):
            try:
                fn = lambda: forward_tma(q, k, v, bool(causal), head_dim ** -0.5, bq, bkv, w, s)  # noqa: E731
                ms = triton.testing.do_bench(fn, return_mode="median")
                print(f"  tma-fwd {bq}x{bkv} w{w} s{s}: {flops / ms * 1e-9:6.1f} TFLOPS ({ms:.3f} ms)", flush=True)
            except Exception as e:
                print(f"  tma-fwd {bq}x{bkv} w{w} s{s}: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--settings", nargs="+",
                   default=["bf16:128:1:8192", "bf16:128:0:8192", "fp16:64:1:8192", "fp16:64:0:8192",
                            "tf32:128:1:4096:fixed", "fp32:128:1:4096:fixed"],
                   help="dtype:head_dim:causal:seq_len[:fixed] (fixed: FLASHATTN_AUTOTUNE=0)")
    p.add_argument("--providers", nargs="+", default=["flashattn", "sdpa", "sdpa-flash", "sdpa-cudnn"])
    p.add_argument("--tokens", type=int, default=128 * 8192)
    p.add_argument("--tma", action="store_true")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    settings = [s.split(":") for s in args.settings]
    tuned = [s for s in settings if len(s) == 4]
    for dtype, hd in sorted({(s[0], int(s[1])) for s in tuned}):
        causals = sorted({bool(int(s[2])) for s in tuned if (s[0], int(s[1])) == (dtype, hd)})
        count, problems = bench.warm_compile([dtype], [hd], causals)
        print(f"# compiled {count} candidates for {dtype} D={hd}; rejected: {problems or 'none'}", flush=True)
    for dtype, hd, causal, n, *fixed in settings:
        os.environ["FLASHATTN_AUTOTUNE"] = "0" if fixed else "1"
        probe(dtype, int(hd), int(causal), int(n), args.tokens, args.providers, args.tma)


if __name__ == "__main__":
    main()
