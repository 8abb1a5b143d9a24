"""Where does the time go? The GPU measurements behind docs/performance.md and chapter 09 (the
full sweep against SDPA is `python -m flashattn.measure.bench`). Needs a CUDA GPU.

    python experiments/perf_probe.py [--settings bf16:128:1:8192 ...] [--tma]
        every tile configuration of every kernel timed at reference settings, next to SDPA
        (--tma: also the forward with tensor descriptors, experiments/fwd_tma.py)
    python experiments/perf_probe.py --ladder figures/data/h200_ladder.csv
        from the starting configuration (float32, 16 x 16 tiles) to the tuned kernel, step by step
    python experiments/perf_probe.py --memory figures/data/h200_memory.csv
        peak memory of forward + backward against N: naive attention, flashattn, SDPA
    python experiments/perf_probe.py --pipelined
        experiments/fwd_pipelined.py (the forward loop reordered by hand) against the
        package's forward, same configurations, same run
"""
import argparse
import os

import flashattn  # first: it picks the runtime before triton is imported
import torch
import triton
from flashattn.gpu import launcher
from flashattn.measure import bench
from flashattn.measure.bench import DTYPES


def config_table(seq_len):
    """The autotuner's timings of every candidate, per kernel, fastest first."""
    bucket = launcher.seq_bucket(seq_len)
    for (name, b), tuner in sorted(launcher._tuners.items()):
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
        from fwd_tma import forward_tma  # next to this script
        q, k, v = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
        flops = bench.attention_flops(1, heads, n, n, head_dim, bool(causal), "fwd")
        for bq, bkv, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)):
            try:
                fn = lambda: forward_tma(q, k, v, bool(causal), head_dim ** -0.5, bq, bkv, w, s)  # noqa: E731
                ms = triton.testing.do_bench(fn, return_mode="median")
                print(f"  tma-fwd {bq}x{bkv} w{w} s{s}: {flops / ms * 1e-9:6.1f} TFLOPS ({ms:.3f} ms)", flush=True)
            except Exception as e:
                print(f"  tma-fwd {bq}x{bkv} w{w} s{s}: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")


#: The ladder, at one setting (causal, head dim 128, N = 4096, 256 heads): each step changes one
#: thing. The first step is the configuration of the FlashAttention kernel this course grew from:
#: float32 with tl.dot's default (TF32 on tensor cores), 16 x 16 forward tiles and 32/16 backward
#: tiles, 4 warps, 3 stages.
START_TILES = {"fwd": dict(BLOCK_Q=16, BLOCK_KV=16, num_warps=4, num_stages=3),
              "bwd_preprocess": dict(BLOCK_Q=32, num_warps=4, num_stages=1),
              "bwd_dkdv": dict(BLOCK_Q=16, BLOCK_KV=32, num_warps=4, num_stages=3),
              "bwd_dq": dict(BLOCK_Q=32, BLOCK_KV=16, num_warps=4, num_stages=3)}
MID_TILES = {"fwd": dict(BLOCK_Q=64, BLOCK_KV=64, num_warps=4, num_stages=3),
             "bwd_preprocess": dict(BLOCK_Q=64, num_warps=4, num_stages=1),
             "bwd_dkdv": dict(BLOCK_Q=32, BLOCK_KV=64, num_warps=4, num_stages=3),
             "bwd_dq": dict(BLOCK_Q=64, BLOCK_KV=64, num_warps=4, num_stages=3)}
LADDER = [  # (step, dtype, matmul precision, tiles or None for autotuned)
    ("start: fp32 (TF32 dots), 16x16 tiles", torch.float32, "high", START_TILES),
    ("fp32 (TF32 dots), tuned tiles", torch.float32, "high", None),
    ("fp32 IEEE dots (FMA), tuned small tiles", torch.float32, "highest", None),
    ("bf16, 16x16 tiles", torch.bfloat16, "highest", START_TILES),
    ("bf16, 64x64 tiles, 4 warps", torch.bfloat16, "highest", MID_TILES),
    ("bf16, tuned tiles/warps/stages", torch.bfloat16, "highest", None),
]


def ladder(path, n=4096, heads=256, head_dim=128, steps=None):
    from flashattn.kernels.backward import attention_backward
    from flashattn.kernels.forward import attention_forward

    # The rungs as recorded: float32 at 'highest' in IEEE (not 3xTF32), 16-bit on the Triton kernel.
    os.environ.update(FLASHATTN_TF32X3="0", FLASHATTN_GLUON="0")
    chosen = [LADDER[i] for i in (steps if steps is not None else range(len(LADDER)))]
    bench.warm_compile(sorted({"bf16" if d == torch.bfloat16 else ("tf32" if p == "high" else "fp32")
                               for _, d, p, t in chosen if t is None}), [head_dim], [True])
    rows = []
    flops = {m: bench.attention_flops(1, heads, n, n, head_dim, True, m) for m in ("fwd", "bwd")}
    for step, dtype, precision, tiles in chosen:
        torch.set_float32_matmul_precision(precision)
        q, k, v, do = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=dtype) for _ in range(4))
        scale = head_dim ** -0.5
        fwd_cfg = tiles and tiles["fwd"]
        bwd_cfg = tiles and {name: tiles[name] for name in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")}
        o, lse2 = attention_forward(q, k, v, True, scale, config=fwd_cfg)

        def backward():  # tunes on its first call if bwd_cfg is None
            return attention_backward(q, k, v, o, lse2, do, True, scale, configs=bwd_cfg)
        backward()
        ms_f = triton.testing.do_bench(lambda: attention_forward(q, k, v, True, scale, config=fwd_cfg),
                                       return_mode="median")
        ms_b = triton.testing.do_bench(backward, return_mode="median")
        for mode, ms in (("fwd", ms_f), ("bwd", ms_b)):
            rows.append(dict(step=step, mode=mode, ms=f"{ms:.3f}", tflops=f"{flops[mode] / ms * 1e-9:.1f}"))
        print(f"  {step:45} fwd {rows[-2]['tflops']:>6} TFLOPS  bwd {rows[-1]['tflops']:>6} TFLOPS", flush=True)
        _write(path, rows, dict(n=n, heads=heads, head_dim=head_dim, causal=1))  # after every step
    if steps is not None:
        return
    for precision in ("highest", "high"):  # SDPA in float32 at the same setting, for reference
        torch.set_float32_matmul_precision(precision)
        res, _ = bench.measure("sdpa", torch.float32, 1, heads, n, head_dim, True)
        step = f"SDPA fp32 (matmul precision {precision})"
        for mode in ("fwd", "bwd"):
            rows.append(dict(step=step, mode=mode, ms=f"{res[mode][0]:.3f}", tflops=f"{res[mode][1]:.1f}"))
        print(f"  {step:45} fwd {res['fwd'][1]:6.1f} TFLOPS  bwd {res['bwd'][1]:6.1f} TFLOPS", flush=True)
    torch.set_float32_matmul_precision("highest")
    res, _ = bench.measure("sdpa", torch.bfloat16, 1, heads, n, head_dim, True)
    for mode in ("fwd", "bwd"):
        rows.append(dict(step="SDPA bf16, default backend", mode=mode, ms=f"{res[mode][0]:.3f}",
                         tflops=f"{res[mode][1]:.1f}"))
    _write(path, rows, dict(n=n, heads=heads, head_dim=head_dim, causal=1))


def pipelined(n=8192, heads=128):
    """The hand-pipelined forward (experiments/fwd_pipelined.py) against the package's
    forward with the same fixed configurations, bf16 and fp16, head dims 64 and 128."""
    from flashattn.kernels.forward import attention_forward
    from fwd_pipelined import forward_pipelined  # next to this script

    for dtype, head_dim, causal in ((torch.bfloat16, 128, True), (torch.bfloat16, 128, False),
                                    (torch.float16, 64, True)):
        q, k, v = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        flops = bench.attention_flops(1, heads, n, n, head_dim, causal, "fwd")
        scale = head_dim ** -0.5
        for bq, bkv, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            config = dict(BLOCK_Q=bq, BLOCK_KV=bkv, num_warps=w, num_stages=s)
            line = f"  {str(dtype)[6:]} D={head_dim} causal={int(causal)} {bq}x{bkv} w{w} s{s}:"
            for label, fn in (("package", lambda: attention_forward(q, k, v, causal, scale, config=config)),
                              ("pipelined", lambda: forward_pipelined(q, k, v, causal, scale, bq, bkv, w, s))):
                try:
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    line += f"  {label} {flops / ms * 1e-9:6.1f} TFLOPS"
                except Exception as e:
                    line += f"  {label} {type(e).__name__}"
            o1, _ = attention_forward(q, k, v, causal, scale, config=config)
            o2, _ = forward_pipelined(q, k, v, causal, scale, bq, bkv, w, s)
            print(line + f"  (max |difference| {(o1.float() - o2.float()).abs().max().item():.1e})", flush=True)


def memory(path, heads=8, head_dim=128, dtype=torch.bfloat16):
    """Peak memory of one forward + backward, above the inputs, against N."""
    from flashattn.testing.reference import naive_attention

    sdpa = bench.provider_fn("sdpa")
    providers = {"naive": lambda q, k, v: naive_attention(q, k, v, is_causal=True)[0],
                 "flashattn": lambda q, k, v: flashattn.attention(q, k, v, is_causal=True),
                 "sdpa": lambda q, k, v: sdpa(q, k, v, True)}
    rows = []
    for n in (1024, 2048, 4096, 8192, 16384):
        for name, fn in providers.items():
            q, k, v = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            do = torch.randn_like(q)
            # A first call outside the measurement: autotuning (do_bench's 256 MB cache-flush
            # buffer) must not count as the kernel's memory.
            fn(q, k, v).backward(do)
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(q, k, v).backward(do)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows.append(dict(provider=name, seq_len=n, peak_mib=f"{peak:.1f}"))
            print(f"  memory N={n:>5} {name:10} {peak:9.1f} MiB", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    _write(path, rows, dict(heads=heads, head_dim=head_dim, dtype=str(dtype).replace("torch.", ""),
                            causal=1, batch=1))


def _write(path, rows, setting):
    import csv
    import time

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), **setting)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(meta) + list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow(dict(meta, **r))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--settings", nargs="+",
                   default=["bf16:128:1:8192", "bf16:128:0:8192", "fp16:64:1:8192", "fp16:64:0:8192",
                            "tf32:128:1:4096:fixed", "fp32:128:1:4096:fixed"],
                   help="dtype:head_dim:causal:seq_len[:fixed] (fixed: FLASHATTN_AUTOTUNE=0)")
    p.add_argument("--providers", nargs="+", default=["flashattn", "sdpa", "sdpa-flash", "sdpa-cudnn"])
    p.add_argument("--tokens", type=int, default=128 * 8192)
    p.add_argument("--tma", action="store_true")
    p.add_argument("--ladder", metavar="CSV", help="run the ladder instead of the settings")
    p.add_argument("--memory", metavar="CSV", help="run the memory sweep instead of the settings")
    p.add_argument("--steps", nargs="+", type=int, help="only these ladder steps (indices into LADDER)")
    p.add_argument("--pipelined", action="store_true", help="run the pipelining experiment only")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.pipelined:
        pipelined()
        return
    if args.ladder or args.memory:
        if args.ladder:
            ladder(args.ladder, steps=args.steps)
        if args.memory:
            memory(args.memory)
        return
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
