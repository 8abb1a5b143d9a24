"""One GPU run that checks and times the Hopper paths: the Gluon forward and float32 on tensor cores.

    python tools/hopper_check.py OUT_DIR [--parts gluon,variants,fp32,bench,fp32bench] [--quick]

Every part runs in child processes, so that an error, a crash or a hang in one (a wrong mbarrier
phase deadlocks the GPU) does not stop the others. A child that prints nothing for a while is
killed, the case it was running is reported as HANG and the child is started again after it.

  gluon      the Gluon forward through flashattn.attention (and the backward through it) against
             float64 under flashattn.testing's rule: fp16/bf16, head dims 64/128, causal or not,
             N in {1, 17, 128, 1000, 4103}, N_q != N_kv, (B, N, H, D)-transposed inputs.
  variants   every tile/ping-pong variant of the Gluon kernel on two shapes (correctness only).
  fp32       float32 over the test grid of tests/test_attention.py (and longer sequences),
             forward and backward: 'highest' (3xTF32) and 'high' (TF32), under the rule.
  bench      forward TFLOPS at B=4, H=32, N in {4096, 8192, 16384}: the Gluon kernel, the Triton
             kernel (autotuned, Gluon disabled) and SDPA's default, side by side; then each
             Gluon variant at N=8192. Writes OUT_DIR/hopper_bench.csv.
  fp32bench  float32 forward and backward TFLOPS at N in {4096, 8192}: 'highest' (3xTF32),
             'high' (TF32) and SDPA's float32. Writes OUT_DIR/fp32_bench.csv.

Lines start with ok / FAIL / HANG / SKIP; everything printed is also written to OUT_DIR/log.txt.
"""
import argparse
import concurrent.futures
import csv
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 128)
#: (name, B, H, N_q, N_kv, layout, backward, magnitude): the Gluon forward's correctness grid.
SHAPES = [
    ("1x1", 1, 2, 1, 1, "bhnd", False, 1.0),
    ("17x17", 2, 3, 17, 17, "bhnd", True, 1.0),
    ("128x128", 2, 3, 128, 128, "bhnd", True, 1.0),
    ("1000x1000", 2, 3, 1000, 1000, "bhnd", True, 1.0),
    ("4103x4103", 1, 2, 4103, 4103, "bhnd", True, 1.0),
    ("17x1000", 2, 3, 17, 1000, "bhnd", True, 1.0),
    ("1000x17", 2, 3, 1000, 17, "bhnd", True, 1.0),
    ("4103x1000", 1, 2, 4103, 1000, "bhnd", False, 1.0),
    ("1000x4103", 1, 2, 1000, 4103, "bhnd", False, 1.0),
    ("1000x1000-bnhd", 2, 3, 1000, 1000, "bnhd", True, 1.0),
    ("200x333-bnhd", 2, 3, 200, 333, "bnhd", False, 1.0),
    ("1000x1000-big", 1, 2, 1000, 1000, "bhnd", False, 6.0),
]
#: Gluon tile variants (besides the default of each head dim) checked and timed.
VARIANTS = {
    64: [dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, PINGPONG=False), dict(BLOCK_M=128, BLOCK_N=64, STAGES=4),
         dict(BLOCK_M=64, BLOCK_N=64, STAGES=4), dict(BLOCK_M=64, BLOCK_N=128, STAGES=2)],
    128: [dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, PINGPONG=False), dict(BLOCK_M=64, BLOCK_N=128, STAGES=3),
          dict(BLOCK_M=64, BLOCK_N=64, STAGES=4)],
}


def gluon_cases(dtype, head_dim, causal):
    return [f"gluon-{dtype}-d{head_dim}-{'causal' if causal else 'full'}-{s[0]}" for s in SHAPES]


# ---------------------------------------------------------------------------- children


def _make(b, h, n, d, layout, dtype, magnitude, gen, device="cuda"):
    import torch
    if layout == "bnhd":  # a (B, N, H, D) tensor seen as (B, H, N, D): no copy, strided
        t = torch.randn(b, n, h, d, generator=gen, device=device).transpose(1, 2)
    else:
        t = torch.randn(b, h, n, d, generator=gen, device=device)
    return (t * magnitude).to(dtype)


def _verdict(cid, checks, extra=""):
    """One line for a case: ok/FAIL, the worst error/bound ratio, each quantity's error/bound."""
    ok = all(c.ok for c in checks)
    worst = max(c.error / c.bound for c in checks)
    detail = "; ".join(f"{c.name} {c.error:.2e}/{c.bound:.2e}" for c in checks)
    print(f"{'ok' if ok else 'FAIL'} {cid}: worst={worst:.2f} error/bound {detail}{extra}", flush=True)


def child_gluon(args):
    """Check each case of one (dtype, head dim, causal) group through flashattn.attention, with a
    counter proving the Gluon kernel ran, and compare with the Triton forward too."""
    import torch
    from flashattn import forward, hopper
    from flashattn.testing import compare_with_reference

    os.environ["FLASHATTN_AUTOTUNE"] = "0"  # the backward's first candidate: fewer compilations
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    calls = []
    launch = hopper.attention_forward

    def counted(*a, **kw):
        calls.append(1)
        return launch(*a, **kw)

    hopper.attention_forward = counted
    skip = set(filter(None, (args.skip or "").split(",")))
    causal = bool(args.causal)
    for cid, (name, b, h, n_q, n_kv, layout, bwd, mag) in zip(
            gluon_cases(args.dtype, args.head_dim, causal), SHAPES):
        if cid in skip:
            continue
        print(f"START {cid}", flush=True)
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = _make(b, h, n_q, args.head_dim, layout, dtype, mag, g)
            k = _make(b, h, n_kv, args.head_dim, layout, dtype, mag, g)
            v = _make(b, h, n_kv, args.head_dim, layout, dtype, 1.0, g)
            assert hopper.supports(q, k, v), "hopper.supports refused these inputs"
            assert (layout == "bnhd") != q.is_contiguous()
            calls.clear()
            checks = compare_with_reference(q, k, v, is_causal=causal, backward=bwd)
            torch.cuda.synchronize()
            assert calls, "flashattn.attention did not call the Gluon kernel"
            os.environ["FLASHATTN_GLUON"] = "0"
            o_triton, _ = forward.attention_forward(q, k, v, causal, args.head_dim ** -0.5)
            os.environ.pop("FLASHATTN_GLUON")
            o_gluon, _ = launch(q, k, v, causal, args.head_dim ** -0.5)
            diff = (o_gluon.float() - o_triton.float()).abs().max().item()
            _verdict(cid, checks, f"; |gluon-triton| {diff:.2e}")
        except Exception as e:
            _fail(cid, e)


def child_variants(args):
    """Each Gluon variant of one head dim, forward only, against float64 under the rule."""
    import torch
    from flashattn import hopper
    from flashattn.autograd import LN2
    from flashattn.testing import compare_with_reference

    skip = set(filter(None, (args.skip or "").split(",")))
    for i, cfg in enumerate(VARIANTS[args.head_dim]):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                for n_q, n_kv in ((1000, 1000), (4103, 777)):
                    cid = f"variant-d{args.head_dim}-{i}-{str(dtype)[6:]}-{int(causal)}-{n_q}x{n_kv}"
                    if cid in skip:
                        continue
                    print(f"START {cid} {cfg}", flush=True)
                    try:
                        g = torch.Generator(device="cuda").manual_seed(1)
                        q = _make(2, 3, n_q, args.head_dim, "bhnd", dtype, 1.0, g)
                        k = _make(2, 3, n_kv, args.head_dim, "bnhd", dtype, 1.0, g)
                        v = _make(2, 3, n_kv, args.head_dim, "bhnd", dtype, 1.0, g)

                        def impl(q, k, v, is_causal, scale, return_lse):
                            o, lse2 = hopper.attention_forward(q, k, v, is_causal, args.head_dim ** -0.5, cfg)
                            return o, lse2 * LN2

                        checks = compare_with_reference(q, k, v, is_causal=causal, backward=False, impl=impl)
                        _verdict(cid, checks, f" {cfg}")
                    except Exception as e:
                        _fail(f"{cid} {cfg}", e)


def fp32_cases():
    """(name, n_q, n_kv, head_dim, causal, magnitude, scale, layout): the float32 calls of
    tests/test_attention.py, plus longer sequences."""
    from test_attention import LENGTHS  # noqa: the grid the CPU tests use
    cases = []
    for n_q, n_kv in LENGTHS:
        for causal in (False, True):
            cases.append((f"len{n_q}x{n_kv}", n_q, n_kv, 64, causal, 1.0, None, "bhnd"))
    for d in (16, 40, 128):
        for causal in (False, True):
            cases.append((f"hd{d}", 69, 69, d, causal, 1.0, None, "bhnd"))
    for d in (1, 3, 24, 96, 200, 256):
        cases.append((f"hd{d}", 33, 40, d, True, 1.0, None, "bhnd"))
    for causal in (False, True):
        cases.append(("113x69", 113, 69, 64, causal, 1.0, None, "bhnd"))
        cases.append(("big", 113, 113, 64, causal, 6.0, None, "bhnd"))
    for scale in (0.05, 1.0, 3.0):
        cases.append((f"scale{scale}", 69, 50, 32, True, 1.0, scale, "bhnd"))
    cases.append(("bnhd", 69, 69, 40, True, 1.0, None, "bnhd"))
    for n in (1000, 2048):
        for d in (64, 128):
            cases.append((f"long{n}-hd{d}", n, n, d, True, 1.0, None, "bhnd"))
    return cases


def child_fp32(args):
    """float32 at one matmul precision over the test grid, forward and backward, under the rule."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from flashattn import tuning
    from flashattn.testing import compare_with_reference

    os.environ["FLASHATTN_AUTOTUNE"] = "0"
    torch.set_float32_matmul_precision(args.precision)
    print(f"info precision {args.precision!r}: tl.dot input_precision "
          f"{tuning.dot_precision(torch.float32)!r}", flush=True)
    skip = set(filter(None, (args.skip or "").split(",")))
    # The grid is split between children: by causal, then in chunks of neighbouring head dims
    # (each head dim compiles its own kernels).
    cases = sorted((c for c in fp32_cases() if int(c[4]) == args.causal), key=lambda c: c[3])
    part, parts = map(int, args.part.split("/"))
    size = -(-len(cases) // parts)
    for name, n_q, n_kv, d, causal, mag, scale, layout in cases[part * size:(part + 1) * size]:
        cid = f"fp32-{args.precision}-{name}-{'causal' if causal else 'full'}"
        if cid in skip:
            continue
        print(f"START {cid}", flush=True)
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = _make(1, 2, n_q, d, layout, torch.float32, mag, g)
            k = _make(1, 2, n_kv, d, layout, torch.float32, mag, g)
            v = _make(1, 2, n_kv, d, layout, torch.float32, 1.0, g)
            checks = compare_with_reference(q, k, v, is_causal=causal, scale=scale)
            _verdict(cid, checks)
        except Exception as e:
            _fail(cid, e)


def child_warm(args):
    """Compile kernels into Triton's disk cache (bench._compile_one runs each once on a small
    input), so that the timing children find them instead of compiling them one by one."""
    import torch
    from flashattn import bench, tuning

    if args.precision == "fwd16":
        jobs = [("fwd", c, dtype, args.head_dim, causal) for dtype in DTYPES for causal in (False, True)
                for c in tuning.GPU_CONFIGS["fwd"][:3]]
    else:  # the float32 candidates of one precision, causal (what fp32bench times)
        dtype = "fp32" if args.precision == "highest" else "tf32"
        torch.set_float32_matmul_precision(args.precision)
        precision = tuning.dot_precision(torch.float32)
        jobs = [(name, c, dtype, args.head_dim, True) for name in ("fwd", "bwd_dkdv", "bwd_dq")
                for c in tuning.candidates(name, torch.float32, precision)
                if tuning.fits(name, c, tuning.block_d(args.head_dim), 4, precision)]
    for name, c, dtype, d, causal in jobs:
        config = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        cid = f"warm-{dtype}-{name}-d{d}-{int(causal)}-{config}"
        print(f"START {cid}", flush=True)
        problem = bench._compile_one((name, config, dtype, d, causal))
        print(f"ok {cid}" if problem is None else f"FAIL {cid}: {problem}", flush=True)


def _fail(cid, e):
    """Report a failed case; after a CUDA error the context is unusable, so exit and let the
    parent start a fresh child after this case."""
    print(f"FAIL {cid}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if "CUDA" in str(e) or "cuda" in type(e).__name__.lower():
        sys.stdout.flush()
        os._exit(3)


def _tflops(ms, b, h, n, d, causal, mode="fwd"):
    from flashattn.bench import attention_flops
    return attention_flops(b, h, n, n, d, causal, mode) / ms * 1e-9


def child_bench(args):
    """Forward TFLOPS side by side: Gluon, Triton (Gluon disabled, autotuned), SDPA's default."""
    import torch
    import triton
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from flashattn import forward, hopper, tuning

    # The Triton forward is tuned over the three candidates that won the full sweep on an H200
    # (figures/data/h200_tile_configs.csv), so that tuning compiles 3 kernels, not 10.
    tuning.GPU_CONFIGS["fwd"] = tuning.GPU_CONFIGS["fwd"][:3]
    bad = set(filter(None, (args.skip or "").split(",")))
    b, h = 4, 32
    seq_lens = (4096, 8192) if args.quick else (4096, 8192, 16384)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    fields = ["gpu", "torch", "triton", "dtype", "head_dim", "causal", "batch", "heads", "seq_len",
              "provider", "config", "ms", "tflops"]
    out = open(os.path.join(args.out, "hopper_bench.csv"), "w", newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()

    def record(dtype, d, causal, n, provider, config, ms):
        tf = _tflops(ms, b, h, n, d, causal)
        writer.writerow(dict(meta, dtype=dtype, head_dim=d, causal=int(causal), batch=b, heads=h,
                             seq_len=n, provider=provider, config=config, ms=f"{ms:.4f}", tflops=f"{tf:.1f}"))
        out.flush()
        return tf

    def triton_fwd(q, k, v, causal):
        os.environ["FLASHATTN_GLUON"] = "0"
        try:
            return forward.attention_forward(q, k, v, causal, q.shape[-1] ** -0.5)
        finally:
            os.environ.pop("FLASHATTN_GLUON")

    print(f"info {meta}", flush=True)
    for dtype_name in DTYPES:
        dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype_name])
        for d in HEAD_DIMS:
            for causal in (False, True):
                group = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
                for n in seq_lens:
                    print(f"START bench-{group}-{n}", flush=True)
                    g = torch.Generator(device="cuda").manual_seed(0)
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
                    res = {}
                    providers = [("triton", lambda: triton_fwd(q, k, v, causal)),
                                 ("sdpa", lambda: sdpa(q, k, v, is_causal=causal))]
                    if group not in bad:
                        providers.insert(0, ("gluon", lambda: hopper.attention_forward(q, k, v, causal, d ** -0.5)))
                    for name, fn in providers:
                        try:
                            fn()
                            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                            res[name] = record(dtype_name, d, causal, n, name, "", ms)
                        except Exception as e:
                            print(f"FAIL bench-{group}-{n} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    sd = res.get("sdpa", float("nan"))
                    cols = "  ".join(f"{p} {t:5.1f} ({t / sd:4.2f}x)" for p, t in res.items())
                    if "gluon" in res and "triton" in res:
                        cols += f"  gluon/triton {res['gluon'] / res['triton']:4.2f}"
                    print(f"ok bench-{group}-{n}: TFLOPS (x sdpa) {cols}", flush=True)
                    q = k = v = None  # free the memory before the next setting
                    torch.cuda.empty_cache()
    # Each Gluon variant at one length, to choose the defaults.
    n = 8192
    for d in HEAD_DIMS:
        print(f"info variants D={d}: " + ", ".join(f"v{i} {cfg}" for i, cfg in
                                                   enumerate([hopper.CONFIGS[d]] + VARIANTS[d])), flush=True)
        for dtype_name in DTYPES:
            dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype_name])
            for causal in (False, True):
                group = f"{dtype_name}-d{d}-{'causal' if causal else 'full'}"
                if group in bad:
                    continue
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
                cols = []
                for i, cfg in enumerate([hopper.CONFIGS[d]] + VARIANTS[d]):
                    if f"variant-d{d}-{i - 1}" in bad:
                        continue
                    print(f"START variant-bench-{group}-{i}", flush=True)
                    try:
                        def fn():
                            return hopper.attention_forward(q, k, v, causal, d ** -0.5, cfg)
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                        tf = record(dtype_name, d, causal, n, f"gluon-v{i}", str(cfg), ms)
                        cols.append(f"v{i} {tf:.1f}")
                    except Exception as e:
                        cols.append(f"v{i} {type(e).__name__}")
                print(f"ok variants-{group}-{n}: TFLOPS " + " | ".join(cols), flush=True)
                q = k = v = None  # free the memory before the next setting
                torch.cuda.empty_cache()
    out.close()


def child_fp32bench(args):
    """float32 forward and backward TFLOPS: 'highest' (3xTF32), 'high' (TF32), SDPA float32."""
    import torch
    import triton
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    import flashattn
    from flashattn import tuning

    b, h = 4, 32
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    fields = ["gpu", "torch", "triton", "precision", "head_dim", "causal", "batch", "heads", "seq_len",
              "provider", "mode", "ms", "tflops"]
    out = open(os.path.join(args.out, "fp32_bench.csv"), "w", newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    seq_lens = (4096,) if args.quick else (4096, 8192)
    for d in HEAD_DIMS:
        for causal in (True,):
            for n in seq_lens:
                cid = f"fp32bench-d{d}-{'causal' if causal else 'full'}-{n}"
                print(f"START {cid}", flush=True)
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).requires_grad_() for _ in range(3))
                do = torch.randn(b, h, n, d, device="cuda", generator=g)
                cols = []
                for provider, precision in (("flashattn", "highest"), ("flashattn", "high"), ("sdpa", "highest")):
                    torch.set_float32_matmul_precision(precision)
                    label = f"{provider}-{precision}"
                    try:
                        fn = (lambda: flashattn.attention(q, k, v, is_causal=causal)) if provider == "flashattn" \
                            else (lambda: sdpa(q, k, v, is_causal=causal))
                        fn().backward(do)  # compile and tune
                        for mode in ("fwd", "bwd"):
                            if mode == "fwd":
                                ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                            else:
                                o = fn()
                                ms = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=5,
                                                             rep=30, grad_to_none=[q, k, v], return_mode="median")
                            tf = _tflops(ms, b, h, n, d, causal, mode)
                            writer.writerow(dict(meta, precision=precision, head_dim=d, causal=int(causal), batch=b,
                                                 heads=h, seq_len=n, provider=provider, mode=mode,
                                                 ms=f"{ms:.4f}", tflops=f"{tf:.1f}"))
                            cols.append(f"{label} {mode} {tf:.1f}")
                        out.flush()
                    except Exception as e:
                        cols.append(f"{label}: {type(e).__name__}: {str(e)[:120]}")
                    q.grad = k.grad = v.grad = None
                print(f"ok {cid}: " + " | ".join(cols) + f"  (3xTF32 as {tuning.dot_precision(torch.float32)} "
                      "under 'highest')", flush=True)
                torch.set_float32_matmul_precision("highest")
                q = k = v = do = None  # free the memory before the next setting
                torch.cuda.empty_cache()
    out.close()


CHILDREN = {"gluon": child_gluon, "variants": child_variants, "fp32": child_fp32, "warm": child_warm,
            "bench": child_bench, "fp32bench": child_fp32bench}


# ---------------------------------------------------------------------------- the parent


def run_job(job, argv, idle_timeout, deadline, max_restarts=3):
    """Run ``--child job argv``. A child that prints nothing for ``idle_timeout`` seconds is
    killed and its current case reported as HANG; a child that dies is reported with its exit
    status. Either way it is started again, skipping the cases already reported (at most
    ``max_restarts`` times). Returns (lines, {case id: 'ok' | 'FAIL' | 'HANG'})."""
    lines, status = [], {}
    for attempt in range(max_restarts + 1):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", job, *argv]
        if status:
            cmd += ["--skip", ",".join(status)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, start_new_session=True)
        out = queue.Queue()

        def read(stream=proc.stdout, out=out):
            for line in stream:
                out.put(line)
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        current, hung = None, False
        while True:
            try:
                line = out.get(timeout=max(1.0, min(idle_timeout, deadline - time.time())))
            except queue.Empty:
                hung = True
                break
            if line is None:
                break
            line = line.rstrip()
            if line.startswith("START "):
                current = line.split()[1]
                continue
            if line.startswith("info") and line in lines:
                continue
            lines.append(line)
            word, _, rest = line.partition(" ")
            if word in ("ok", "FAIL") and rest:
                status[rest.split(":")[0].split()[0]] = word
        if hung:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group, started above
            proc.wait()
            late = time.time() >= deadline
            lines.append(f"HANG {current or job}: " + ("out of time" if late else
                                                        f"no output for {idle_timeout:.0f} s") + "; killed")
            if current is None or late:
                break
            status.setdefault(current, "HANG")
            continue
        code = proc.wait()
        if code == 0:
            break
        if current not in status:  # died without a verdict (a crash, or an error before any case)
            lines.append(f"FAIL {job} {' '.join(argv)}: child exited with status {code}"
                         + (f" during {current}" if current else ""))
        if current is None or time.time() >= deadline:
            break
        status.setdefault(current, "FAIL")
    return lines, status


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=".")
    p.add_argument("--parts", default="gluon,variants,fp32,bench,fp32bench")
    p.add_argument("--quick", action="store_true", help="fewer lengths in the timings")
    p.add_argument("--workers", type=int, default=12, help="checking children run at once")
    p.add_argument("--budget", type=float, default=285, help="seconds for the whole run")
    p.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    for name in ("--dtype", "--precision", "--skip", "--part"):
        p.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--head-dim", "--causal"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
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
    jobs = []  # (label, job, argv, idle timeout), the most important first
    if "gluon" in parts:
        for dtype in DTYPES:
            for d in HEAD_DIMS:
                for causal in (0, 1):
                    jobs.append((f"gluon {dtype} D={d} causal={causal}", "gluon",
                                 ["--dtype", dtype, "--head-dim", str(d), "--causal", str(causal)], 60))
    for d in HEAD_DIMS:  # compile what the timings use while the checks run
        if "bench" in parts:
            jobs.append((f"warm triton fwd D={d}", "warm", ["--precision", "fwd16", "--head-dim", str(d)], 90))
        if "fp32bench" in parts:
            for precision in ("highest", "high"):
                jobs.append((f"warm fp32 {precision} D={d}", "warm",
                             ["--precision", precision, "--head-dim", str(d)], 90))
    if "variants" in parts:
        for d in HEAD_DIMS:
            jobs.append((f"variants D={d}", "variants", ["--head-dim", str(d)], 60))
    if "fp32" in parts:
        for precision in ("highest", "high"):
            for causal, chunks in ((1, 3), (0, 2)):
                for i in range(chunks):
                    jobs.append((f"fp32 {precision} causal={causal} part {i + 1}/{chunks}", "fp32",
                                 ["--precision", precision, "--causal", str(causal), "--part", f"{i}/{chunks}"], 90))
    counts, bad, problems = {}, set(), []
    check_deadline = start + 0.42 * args.budget if {"bench", "fp32bench"} & set(parts) else deadline
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        futures = {pool.submit(run_job, job, argv, idle, check_deadline): label
                   for label, job, argv, idle in jobs}
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
            for line in lines:  # everything to the log, the first few failures to the screen too
                failed = line.startswith(("FAIL", "HANG"))
                shown += failed
                say("   " + line, also_stdout=(failed and shown <= 4) or line.startswith("info"))
                if failed:
                    problems.append(f"{label}: {line}")
            for case, word in status.items():
                counts[word] = counts.get(word, 0) + 1
            if label.startswith("gluon") and (tally["FAIL"] or tally["HANG"] or not status):
                dtype, d, c = label.split()[1:4]
                bad.add(f"{dtype}-d{d[2:]}-{'causal' if c.endswith('1') else 'full'}")
            for case, word in status.items():
                if word != "ok" and case.startswith("variant-"):
                    bad.add("-".join(case.split("-")[:3]))
    say(f"== checks: {counts} ({time.time() - start:.0f} s); left out of the timings: {sorted(bad) or 'none'}")
    for part, idle in (("bench", 120), ("fp32bench", 150)):
        if part not in parts:
            continue
        left = deadline - time.time()
        if left < 20:
            say(f"SKIP {part}: out of time")
            continue
        argv = [args.out] + (["--quick"] if args.quick else [])
        if bad and part == "bench":
            argv += ["--skip", ",".join(sorted(bad))]
        share = 0.5 if part == "bench" and "fp32bench" in parts else 1.0
        lines, _ = run_job(part, argv, idle, time.time() + share * left, max_restarts=0)
        say(f"== {part} ({time.time() - start:.0f} s)")
        for line in lines:
            say("   " + line[:400])
            if line.startswith(("FAIL", "HANG")):
                problems.append(f"{part}: {line}")
    say(f"== {len(problems)} problems (all in log.txt)" + "".join(f"\n   {p[:200]}" for p in problems[:25]))
    say(f"done in {time.time() - start:.0f} s; log and CSVs in {os.path.abspath(args.out)}")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
