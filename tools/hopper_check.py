"""One GPU run that checks and times the Hopper paths: the Gluon kernels and float32 on tensor cores.

    python tools/hopper_check.py OUT_DIR [--parts checks,fp32,bench,fp32bench] [--full] [--budget 285]

Every part runs in child processes (flashattn.measure.gpu_checks.run_job), so that an error, a crash or a
hang in one does not stop the others: a child that prints nothing for a while is killed, the case
it was running is reported as HANG, and the child is started again after it.

  checks     the Gluon forward and dK/dV through flashattn.attention against float64, per (dtype,
             head dim, causal) group, and each Gluon forward variant (flashattn.measure.gpu_checks).
  fp32       float32 under the rule, in separate children per precision ('highest' = IEEE, or
             3xTF32 with FLASHATTN_TF32X3=1; 'high' = TF32): the test grid through
             flashattn.attention, and every candidate tile configuration of every kernel at head
             dims 32, 64 and 128 launched explicitly, plus the configurations excluded for a
             compiler fault (expected to fail).
  bench      16-bit TFLOPS at B=4, H=32, N in {4096, 8192} (and 16384 with --full), side by side
             and interleaved (3 rounds, median): the forward (Gluon, Triton autotuned with Gluon
             off, SDPA's default), the backward (flashattn with the Gluon dK/dV, flashattn with
             the Triton one, SDPA's default) and the Gluon dK/dV kernel alone; then every Gluon
             variant (forward and dK/dV) at N = 8192. Writes OUT_DIR/hopper_bench.csv.
  fp32bench  float32 forward and backward TFLOPS, causal, N = 4096 (and 8192 with --full):
             flashattn at 'highest' (IEEE, or 3xTF32 with FLASHATTN_TF32X3=1) and 'high' (TF32),
             SDPA at 'highest' and 'high', each in its own child. Writes OUT_DIR/fp32_bench.csv.

Lines start with ok / FAIL / HANG / SKIP / info; everything printed is also in OUT_DIR/log.txt.
"""
import argparse
import concurrent.futures
import csv
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flashattn.measure.gpu_checks import BWD_VARIANTS, DTYPES, HEAD_DIMS, SHAPES, VARIANTS, command, run_job
#: Candidates the Triton kernels are tuned over in the timings (the first of each list, which won
#: the full sweep on an H200: figures/data/h200_tile_configs.csv), so that tuning compiles few.
TUNED = {"fwd": 3, "bwd_dkdv": 4, "bwd_dq": 4}
FP32_PROVIDERS = [("flashattn", "highest"), ("flashattn", "high"), ("sdpa", "highest"), ("sdpa", "high")]
META_FIELDS = ["gpu", "torch", "triton"]


# ---------------------------------------------------------------------------- timing children


def _meta():
    import torch
    import triton
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)


def _tflops(ms, b, h, n, d, causal, mode):
    from flashattn.measure.bench import attention_flops
    return attention_flops(b, h, n, n, d, causal, "bwd" if mode == "dkdv" else mode) / ms * 1e-9


def _interleaved(fns, rounds=3):
    """Median milliseconds of each function in ``fns`` (name -> callable), timed in turn, round
    after round, so that a drift of the GPU's clocks touches them all alike. A function that
    raises gets its exception's name instead of a time."""
    import triton
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if isinstance(times[name], str):
                continue
            try:
                times[name].append(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
            except Exception as e:
                times[name] = f"{type(e).__name__}: {str(e)[:100]}"
    return {name: t if isinstance(t, str) else statistics.median(t) for name, t in times.items()}


def _restrict_tuning():
    from flashattn.gpu import configs
    for name, n in TUNED.items():
        configs.GPU_CONFIGS[name] = configs.GPU_CONFIGS[name][:n]


def child_warm(args):
    """Compile kernels into Triton's disk cache (bench._compile_one runs each once on a small
    input), so that the timing children find them instead of compiling them one by one."""
    import torch
    from flashattn.gpu import configs
    from flashattn.measure import bench

    if args.precision == "16bit":
        jobs = [(name, c, dtype, args.head_dim, causal) for dtype in DTYPES for causal in (False, True)
                for name in TUNED for c in configs.GPU_CONFIGS[name][:TUNED[name]]]
    else:  # the float32 candidates of one precision, causal (what fp32bench times)
        dtype = "fp32" if args.precision == "highest" else "tf32"
        torch.set_float32_matmul_precision(args.precision)
        precision = configs.dot_precision(torch.float32)
        jobs = [(name, c, dtype, args.head_dim, True) for name in ("fwd", "bwd_dkdv", "bwd_dq")
                for c in configs.candidates(name, torch.float32, precision)
                if configs.fits(name, c, configs.block_d(args.head_dim), 4, precision)]
    for name, c, dtype, d, causal in jobs:
        config = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        cid = f"warm-{dtype}-{name}-d{d}-{int(causal)}-{c.kwargs['BLOCK_Q']}x{c.kwargs['BLOCK_KV']}w{c.num_warps}s{c.num_stages}"
        print(f"START {cid}", flush=True)
        problem = bench._compile_one((name, config, dtype, d, causal))
        print(f"ok {cid}" if problem is None else f"FAIL {cid}: {problem}", flush=True)


def child_bench(args):
    """16-bit forward and backward TFLOPS side by side, then the Gluon variants."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from flashattn.hopper import forward as hopper, backward as hopper_backward
    from flashattn.kernels import backward, forward

    _restrict_tuning()
    bad = set(filter(None, (args.skip or "").split(",")))
    b, h = 4, 32
    seq_lens = (8192, 4096, 16384) if args.full else (8192, 4096)
    meta = _meta()
    out = open(os.path.join(args.out, "hopper_bench.csv"), "w", newline="")
    writer = csv.DictWriter(out, fieldnames=META_FIELDS + ["dtype", "head_dim", "causal", "batch", "heads",
                                                          "seq_len", "mode", "provider", "config", "ms", "tflops"])
    writer.writeheader()

    def record(dtype, d, causal, n, mode, results, configs=None):
        row = {}
        for name, ms in results.items():
            if isinstance(ms, str):
                row[name] = ms
                continue
            tf = _tflops(ms, b, h, n, d, causal, mode)
            writer.writerow(dict(meta, dtype=dtype, head_dim=d, causal=int(causal), batch=b, heads=h, seq_len=n,
                                 mode=mode, provider=name, config=(configs or {}).get(name, ""),
                                 ms=f"{ms:.4f}", tflops=f"{tf:.1f}"))
            row[name] = tf
        out.flush()
        return row

    def gluon_off(fn):
        def run():
            os.environ["FLASHATTN_GLUON"] = "0"
            try:
                return fn()
            finally:
                os.environ.pop("FLASHATTN_GLUON")
        return run

    def line(prefix, row, base):
        ref = row.get(base)
        cols = []
        for name, tf in row.items():
            if isinstance(tf, str):
                cols.append(f"{name} {tf}")
            else:
                cols.append(f"{name} {tf:5.1f}" + (f" ({tf / ref:4.2f}x)" if isinstance(ref, float) else ""))
        return f"ok {prefix}: TFLOPS (x {base}) " + "  ".join(cols)

    print(f"info {meta}; interleaved, 3 rounds, median", flush=True)
    settings = [(n, dt, d, c) for n in seq_lens for dt in DTYPES for d in HEAD_DIMS for c in (False, True)]
    for n, dtype_name, d, causal in settings:
        group = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
        dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype_name])
        print(f"START bench-{group}-{n}", flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
        scale = d ** -0.5
        fwd = {"gluon": lambda: hopper.attention_forward(q, k, v, causal, scale),
               "triton": gluon_off(lambda: forward.attention_forward(q, k, v, causal, scale)),
               "sdpa": lambda: sdpa(q, k, v, is_causal=causal)}
        if group in bad:
            fwd.pop("gluon")
        for fn in fwd.values():
            fn()  # compile and tune outside the timings
        print(line(f"fwd-{group}-{n}", record(dtype_name, d, causal, n, "fwd", _interleaved(fwd)), "sdpa"), flush=True)
        o, lse2 = forward.attention_forward(q, k, v, causal, scale)
        delta = (o.float() * do.float()).sum(-1)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out_s = sdpa(*leaves, is_causal=causal)
        bwd = {"gluon": lambda: backward.attention_backward(q, k, v, o, lse2, do, causal, scale),
               "triton": gluon_off(lambda: backward.attention_backward(q, k, v, o, lse2, do, causal, scale)),
               "sdpa": lambda: torch.autograd.grad(out_s, leaves, do, retain_graph=True),
               "gluon-dkdv": lambda: hopper_backward.attention_backward_dkdv(q, k, v, do, lse2, delta, causal, scale)}
        if group in bad:
            for name in ("gluon", "gluon-dkdv"):
                bwd.pop(name)
        for fn in bwd.values():
            fn()
        print(line(f"bwd-{group}-{n}", record(dtype_name, d, causal, n, "bwd", _interleaved(bwd)), "sdpa"), flush=True)
        q = k = v = do = o = lse2 = delta = leaves = out_s = None  # free before the next setting
        torch.cuda.empty_cache()

    # Each variant at one length, interleaved with the default it would replace.
    n = 8192
    for d in HEAD_DIMS:
        for causal in (False, True):
            fwd_cfgs = [{}] + VARIANTS[d]
            bwd_cfgs = [{}] + BWD_VARIANTS[d]
            print(f"info variants D={d} causal={int(causal)}: fwd " + ", ".join(
                f"v{i} {hopper.tile_config(d, causal, c)}" for i, c in enumerate(fwd_cfgs)) + "; dkdv " + ", ".join(
                f"w{i} {hopper_backward.tile_config(d, c)}" for i, c in enumerate(bwd_cfgs)), flush=True)
            for dtype_name in DTYPES:
                group = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
                if group in bad:
                    continue
                dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype_name])
                print(f"START variants-{group}-{n}", flush=True)
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
                fns, configs = {}, {}
                for i, c in enumerate(fwd_cfgs):
                    if f"variant-d{d}-{i - 1}-{dtype_name}" not in bad:
                        fns[f"v{i}"] = (lambda c=c: hopper.attention_forward(q, k, v, causal, d ** -0.5, c))
                        configs[f"v{i}"] = str(hopper.tile_config(d, causal, c))
                for fn in fns.values():
                    fn()
                print(line(f"variants-fwd-{group}-{n}", record(dtype_name, d, causal, n, "fwd",
                                                               _interleaved(fns), configs), "v0"), flush=True)
                o, lse2 = hopper.attention_forward(q, k, v, causal, d ** -0.5)
                delta = (o.float() * do.float()).sum(-1)
                fns, configs = {}, {}
                for i, c in enumerate(bwd_cfgs):
                    if f"dkdv-variant-d{d}-{i - 1}-{dtype_name}" in bad:
                        continue
                    fns[f"w{i}"] = (lambda c=c: hopper_backward.attention_backward_dkdv(
                        q, k, v, do, lse2, delta, causal, d ** -0.5, c))
                    configs[f"w{i}"] = str(hopper_backward.tile_config(d, c))
                for fn in fns.values():
                    fn()
                print(line(f"variants-dkdv-{group}-{n}", record(dtype_name, d, causal, n, "dkdv",
                                                                _interleaved(fns), configs), "w0"), flush=True)
                q = k = v = do = o = lse2 = delta = None
                torch.cuda.empty_cache()
    out.close()


def child_fp32bench(args):
    """float32 forward and backward TFLOPS of one provider at one precision, causal."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    import flashattn
    from flashattn.gpu import configs

    provider, precision = args.provider.split(":")
    torch.set_float32_matmul_precision(precision)
    b, h = 4, 32
    meta = _meta()
    path = os.path.join(args.out, f"fp32_bench-{provider}-{precision}.csv")
    out = open(path, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=META_FIELDS + ["precision", "dot", "head_dim", "causal", "batch",
                                                          "heads", "seq_len", "provider", "mode", "ms", "tflops"])
    writer.writeheader()
    dot = configs.dot_precision(torch.float32) if provider == "flashattn" else "cuBLAS/cuDNN"
    for d in HEAD_DIMS:
        for n in ((4096, 8192) if args.full else (4096,)):
            cid = f"fp32bench-{provider}-{precision}-d{d}-causal-{n}"
            print(f"START {cid}", flush=True)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).requires_grad_() for _ in range(3))
            do = torch.randn(b, h, n, d, device="cuda", generator=g)
            fn = (lambda: flashattn.attention(q, k, v, is_causal=True)) if provider == "flashattn" \
                else (lambda: sdpa(q, k, v, is_causal=True))
            o = fn()
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # compile and tune
            times = _interleaved({"fwd": fn, "bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)})
            cols = []
            for mode, ms in times.items():
                tf = _tflops(ms, b, h, n, d, True, mode)
                writer.writerow(dict(meta, precision=precision, dot=dot, head_dim=d, causal=1, batch=b, heads=h,
                                     seq_len=n, provider=provider, mode=mode, ms=f"{ms:.4f}", tflops=f"{tf:.1f}"))
                cols.append(f"{mode} {tf:.1f}")
            out.flush()
            print(f"ok {cid}: TFLOPS {' '.join(cols)} ({dot})", flush=True)
            q = k = v = do = o = None
            torch.cuda.empty_cache()
    out.close()


CHILDREN = {"warm": child_warm, "bench": child_bench, "fp32bench": child_fp32bench}


# ---------------------------------------------------------------------------- the parent


def _own(child, **options):
    argv = [sys.executable, os.path.abspath(__file__), "--child", child]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=".")
    p.add_argument("--parts", default="checks,fp32,bench,fp32bench")
    p.add_argument("--full", action="store_true", help="longer sequences in the timings (more than 5 minutes)")
    p.add_argument("--workers", type=int, default=14, help="checking children run at once")
    p.add_argument("--budget", type=float, default=285, help="seconds for the whole run")
    p.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    for name in ("--precision", "--skip", "--provider"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--head-dim", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return CHILDREN[args.child](args)

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "log.txt"), "w")
    start = time.time()
    deadline = start + args.budget

    def say(line, also_stdout=True):
        if also_stdout:
            print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    import torch
    import triton
    say(f"hopper_check: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, "
        f"torch {torch.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    if not torch.cuda.is_available():
        say("FAIL no CUDA GPU")
        return 1
    parts = args.parts.split(",")
    jobs = []  # (label, command, idle timeout), the most important first
    if "checks" in parts:
        for dtype in DTYPES:
            for d in HEAD_DIMS:
                for causal in (0, 1):
                    jobs.append((f"gluon {dtype} D={d} causal={causal}",
                                 command("gluon", dtype=dtype, head_dim=d, causal=causal), 60))
    for d in HEAD_DIMS:  # compile what the timings use while the checks run
        if "bench" in parts:
            jobs.append((f"warm triton 16-bit D={d}", _own("warm", precision="16bit", head_dim=d), 90))
        if "fp32bench" in parts:
            for precision in ("highest", "high"):
                jobs.append((f"warm fp32 {precision} D={d}", _own("warm", precision=precision, head_dim=d), 90))
    if "checks" in parts:
        for d in HEAD_DIMS:
            for dtype in DTYPES:
                jobs.append((f"variants {dtype} D={d}", command("variants", dtype=dtype, head_dim=d), 90))
    if "fp32" in parts:
        for precision in ("highest", "high"):
            for d in (32, 64, 128):
                jobs.append((f"fp32 configs {precision} D={d}", command("configs", precision=precision, head_dim=d), 60))
            for causal, chunks in ((1, 3), (0, 2)):
                for i in range(chunks):
                    jobs.append((f"fp32 grid {precision} causal={causal} part {i + 1}/{chunks}",
                                 command("fp32", precision=precision, causal=causal, part=f"{i}/{chunks}"), 90))
    counts, bad, problems = {}, set(), []
    timing = {"bench", "fp32bench"} & set(parts)
    check_deadline = start + 0.4 * args.budget if timing else deadline
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        futures = {pool.submit(run_job, cmd, idle, check_deadline, 8 if " configs " in label else 3, ROOT): label
                   for label, cmd, idle in jobs}
        for fut in concurrent.futures.as_completed(futures):
            label = futures[fut]
            lines, status = fut.result()
            tally = {w: sum(v == w for v in status.values()) for w in ("ok", "FAIL", "HANG")}
            expected = len(SHAPES) if label.startswith("gluon") else len(status)
            missing = f", {expected - len(status)} not run" if expected > len(status) else ""
            ratios = [(float(m.group(1)), line.split()[1]) for line in lines
                      for m in [re.search(r"worst=([0-9.einf]+)", line)] if m]
            worst = f", worst error/bound {max(ratios)[0]:.2f} ({max(ratios)[1]})" if ratios else ""
            say(f"== {label}: {tally['ok']} ok, {tally['FAIL']} FAIL, {tally['HANG']} HANG{missing}{worst} "
                f"({time.time() - start:.0f} s)")
            shown = 0
            for line in lines:  # everything to the log, the first few failures and the infos to the screen
                failed = line.startswith(("FAIL", "HANG"))
                shown += failed
                say("   " + line[:300], also_stdout=(failed and shown <= 4) or line.startswith("info"))
                if failed:
                    problems.append(f"{label}: {line}")
            for word in status.values():
                counts[word] = counts.get(word, 0) + 1
            if label.startswith("gluon") and (tally["FAIL"] or tally["HANG"] or not status):
                dtype, d, c = label.split()[1:4]
                bad.add(f"{dtype}-d{d[2:]}-{'causal' if c.endswith('1') else 'full'}")
            for case, word in status.items():  # a variant that failed is not timed
                if word != "ok" and case.startswith(("variant-", "dkdv-variant-")):
                    bad.add(case.rsplit("-", 1)[0])
    say(f"== checks: {counts} ({time.time() - start:.0f} s); left out of the timings: {sorted(bad) or 'none'}")

    timings = []
    if "bench" in parts:
        argv = [args.out] + (["--full"] if args.full else []) + (["--skip", ",".join(sorted(bad))] if bad else [])
        timings.append(("bench", _own("bench") + argv, 0.7))
    if "fp32bench" in parts:
        for provider, precision in FP32_PROVIDERS:
            timings.append((f"fp32bench {provider} {precision}",
                            _own("fp32bench", provider=f"{provider}:{precision}") + [args.out]
                            + (["--full"] if args.full else []), 0.3 / len(FP32_PROVIDERS)))
    for i, (label, cmd, share) in enumerate(timings):
        left = deadline - time.time()
        if left < 15:
            say(f"SKIP {label}: out of time")
            continue
        # the bench gets its share of what is left; each fp32 provider an equal share of the rest
        rest = sum(s for _, _, s in timings[i:])
        lines, _ = run_job(cmd, 150, time.time() + left * share / rest, max_restarts=0, cwd=ROOT)
        say(f"== {label} ({time.time() - start:.0f} s)")
        for line in lines:
            say("   " + line[:400])
            if line.startswith(("FAIL", "HANG")):
                problems.append(f"{label}: {line}")
    if "fp32bench" in parts:  # one CSV from the providers' own
        rows = []
        for provider, precision in FP32_PROVIDERS:
            path = os.path.join(args.out, f"fp32_bench-{provider}-{precision}.csv")
            if os.path.exists(path):
                rows += list(csv.DictReader(open(path)))
                os.remove(path)
        if rows:
            with open(os.path.join(args.out, "fp32_bench.csv"), "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    say(f"== {len(problems)} problems (all in log.txt)" + "".join(f"\n   {p[:200]}" for p in problems[:25]))
    say(f"done in {time.time() - start:.0f} s; log and CSVs in {os.path.abspath(args.out)}")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
