"""On a GPU: how long the first call takes, and what the default configurations cost against autotuned ones.

    python tools/first_call.py            # about 3 minutes on an H200
    python tools/first_call.py --quick    # the first-call table only
    python tools/first_call.py --quick --repeat 3   # each first call in three fresh processes
    python tools/first_call.py --timeline # where a first call's seconds go, thread by thread

Every measurement runs in a fresh Python process with an empty Triton cache (``TRITON_CACHE_DIR``)
and an empty flashattn cache (``FLASHATTN_CACHE_DIR``), as a new user's first run would. Python's
compiled bytecode is there, as it is for installed packages (pip compiles it at install): a
throwaway first call fills a bytecode folder (``PYTHONPYCACHEPREFIX``) that the measured processes
share, so that a machine whose packages ship without bytecode does not time compiling torch's and
sympy's sources (torch imports sympy at the first ``backward`` given a gradient).

1. **First call.** For several new (dtype, head dim, causal) settings: the seconds from nothing
   compiled to the first forward + backward finished (``import flashattn`` timed apart), then the
   second call, and SDPA's first call in the same process for comparison. The target is 5 s.
2. **Default against autotuned**, at the reference setting (bf16, causal, head dim 128, B = 4,
   H = 32, N = 8192): forward and backward times with the defaults (nothing timed), and with
   ``FLASHATTN_AUTOTUNE=1`` (after the autotuning call, which is timed too); then a third process
   with ``FLASHATTN_AUTOTUNE=1`` and the second's cache, whose first call must not tune again. The
   target is default >= 0.95x autotuned. On an H100/H200 the 16-bit forward at head dims 64 and 128
   is the Gluon kernel whatever the setting; the rows with ``FLASHATTN_GLUON=0`` compare the Triton
   forward's default with its autotuned choice.

``--timeline`` runs a few of the first-call settings with Triton's compile steps timed (each
kernel's compile and its stages, the C modules Triton builds with the system compiler, loading a
kernel onto the GPU, hashing Triton's own files for its cache keys) and prints, per setting, what
each thread did and when, from the start of the first call.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
start = time.perf_counter()
import torch
import flashattn
imported = time.perf_counter() - start
from triton.testing import do_bench

dtype, head_dim, causal, batch, heads, seq_len, bench = sys.argv[1:8]
dtype = getattr(torch, dtype)
head_dim, causal, batch, heads, seq_len = int(head_dim), causal == "1", int(batch), int(heads), int(seq_len)
q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=dtype, requires_grad=True)
           for _ in range(3))
g = torch.randn_like(q)


timed_steps = os.environ.get("FIRST_CALL_TIMELINE") == "1"
if timed_steps:
    exec(TIMELINE)


def step(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(q, k, v, is_causal=causal)
    out.backward(g)
    torch.cuda.synchronize()
    return time.perf_counter() - t


result = dict(imported=imported, first=step(flashattn.attention), second=step(flashattn.attention))
result["sdpa_first"] = step(torch.nn.functional.scaled_dot_product_attention)
if bench == "1":
    out = flashattn.attention(q, k, v, is_causal=causal)
    result["fwd_ms"] = do_bench(lambda: flashattn.attention(q, k, v, is_causal=causal))
    result["bwd_ms"] = do_bench(lambda: out.backward(g, retain_graph=True))
if timed_steps:
    result["events"] = [(thread, label, begin - T0[0], end - T0[0]) for thread, label, begin, end in EVENTS]
    spans = []  # runs of samples of one thread at one place, as (thread, start, end, place)
    for thread, now, place in SAMPLES:
        same = [i for i in range(len(spans) - 1, max(-1, len(spans) - 8), -1) if spans[i][0] == thread]
        if same and spans[same[0]][3] == place and now - spans[same[0]][2] < 0.05:
            spans[same[0]][2] = now
        else:
            spans.append([thread, now, now, place])
    result["events"] += [(t, "sampled: " + place, a - T0[0], b - T0[0]) for t, a, b, place in spans if b - a >= 0.1]
print("RESULT " + json.dumps(result))
"""

# Hooks for --timeline, run in the child before the first call: each wraps one step of Triton's
# compile (or of flashattn's op) and records (thread, label, start, end).
TIMELINE = r"""
import threading
import triton.runtime.build, triton.runtime.cache, triton.runtime.jit, triton.compiler.compiler
import triton.backends.nvidia.compiler as nvidia
import flashattn.ops.autograd, flashattn.ops.warmup

EVENTS, T0, _current = [], [time.perf_counter()], threading.local()


def timed(fn, label):
    def wrapper(*args, **kwargs):
        what, begin = label(*args, **kwargs), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((threading.current_thread().name, what, begin, time.perf_counter()))
    return wrapper


def _compile(self, *args, **kwargs):
    _current.name = self.fn.__name__
    return _do_compile(self, *args, **kwargs)


_do_compile = triton.runtime.jit.JITFunction._do_compile
triton.runtime.jit.JITFunction._do_compile = timed(_compile, lambda self, *a, **k: f"compile {self.fn.__name__}")
_add_stages = nvidia.CUDABackend.add_stages


def add_stages(self, stages, *args, **kwargs):
    _add_stages(self, stages, *args, **kwargs)
    for name, fn in list(stages.items()):
        stages[name] = timed(fn, lambda *a, name=name: f"  {name} of {getattr(_current, 'name', '?')}")


nvidia.CUDABackend.add_stages = add_stages
triton.runtime.cache.triton_key = timed(triton.runtime.cache.triton_key, lambda: "hash Triton's files (cache key)")
triton.runtime.build._build = timed(triton.runtime.build._build, lambda name, *a, **k: f"C compiler: {name}")
_CK = triton.compiler.compiler.CompiledKernel
_CK._init_handles = timed(_CK._init_handles, lambda self: f"load {self.name}" if self.module is None else "")
flashattn.ops.autograd.attention_forward = timed(flashattn.ops.autograd.attention_forward, lambda *a, **k: "forward op")
flashattn.ops.autograd.attention_backward = timed(flashattn.ops.autograd.attention_backward, lambda *a, **k: "backward op")
flashattn.ops.warmup.wait = timed(flashattn.ops.warmup.wait, lambda: "wait for the backward's compile")
flashattn.ops.warmup._prepare_triton = timed(flashattn.ops.warmup._prepare_triton, lambda: "prepare Triton (warm-up)")
flashattn.ops.autograd.FlashAttention.backward = staticmethod(
    timed(flashattn.ops.autograd.FlashAttention.backward, lambda *a: "FlashAttention.backward"))
torch.Tensor.backward = timed(torch.Tensor.backward, lambda *a, **k: "Tensor.backward")
SAMPLES = []  # (thread, time, innermost frames): where each thread's Python was, every 10 ms


def sample():
    me = threading.get_ident()
    while len(SAMPLES) < 200000:
        now, names = time.perf_counter(), {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            stack = []
            while frame is not None and len(stack) < 4:
                code = frame.f_code
                stack.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            if ident != me and not stack[0].startswith(("threading.py", "thread.py", "queue.py")):
                SAMPLES.append((names.get(ident, "?"), now, " < ".join(stack)))
        time.sleep(0.01)


threading.Thread(target=sample, daemon=True, name="sampler").start()
torch.cuda.synchronize()
T0[0] = time.perf_counter()
"""


def timeline():
    """Per setting, the first call's events in order: thread, start and end (seconds from the call's
    start), what it was."""
    import torch

    print(f"## where the first call's seconds go ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}); fresh process, empty caches")
    for setting, extra in ((("bfloat16", 128, 1, 2, 16, 2048), {}), (("float32", 128, 1, 2, 8, 1024), {}),
                           (("bfloat16", 128, 1, 2, 16, 2048), {"FLASHATTN_GLUON": "0"})):
        r = child((*setting, 0), {**extra, "FIRST_CALL_TIMELINE": "1"})
        print(f"\n### {' '.join(map(str, setting))} {' '.join(f'{k}={v}' for k, v in extra.items())}")
        if "error" in r:
            print(f"ERROR {r['error']}")
            continue
        print(f"import {r['imported']:.2f} s, first forward + backward {r['first']:.2f} s, second {r['second']:.3f} s")
        for thread, label, begin, end in sorted(r["events"], key=lambda e: e[2]):
            if label and begin < r["first"]:
                print(f"{thread[:18]:18} {begin:6.2f} {end:6.2f} {end - begin:6.2f}  {label}")


def child(setting, env_extra, cache=None):
    """Run one measurement in a fresh process; returns its result dict (or the error text)."""
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as own_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "FLASHATTN_CACHE_DIR": cache or own_cache}
        env.pop("FLASHATTN_AUTOTUNE", None)
        env.update(env_extra)
        start = time.perf_counter()
        code = f"TIMELINE = {TIMELINE!r}\n" + CHILD
        proc = subprocess.run([sys.executable, "-c", code, *map(str, setting)], env=env, capture_output=True,
                              text=True, timeout=900)
        wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), wall=wall)
    return dict(error=(proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"], wall=wall)


def first_calls(repeat=1):
    import statistics

    import torch

    print(f"## first call in a fresh process, empty caches ({torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {__import__('triton').__version__})"
          + (f"; each setting {repeat} times, the median and every run" if repeat > 1 else ""))
    print(f"{'setting':40} {'import':>7} {'1st fwd+bwd':>12} {'2nd':>7} {'SDPA 1st':>9} {'<= 5 s':>7}")
    settings = [("bfloat16", 128, 1, 2, 16, 2048), ("float16", 64, 0, 2, 16, 2048), ("bfloat16", 96, 1, 2, 16, 1000),
                ("float16", 256, 0, 1, 8, 1024), ("float32", 128, 1, 2, 8, 1024), ("bfloat16", 64, 1, 1, 8, 777)]
    for extra in ({}, {"FLASHATTN_GLUON": "0"}):
        for dtype, d, causal, b, h, n in settings:
            label = f"{dtype} D={d} {'causal' if causal else 'full'} {b}x{h}x{n}" + (" GLUON=0" if extra else "")
            runs = [child((dtype, d, causal, b, h, n, 0), extra) for _ in range(repeat)]
            errors = [r["error"] for r in runs if "error" in r]
            if errors:
                print(f"{label:40} ERROR {errors[0]}")
                continue
            r = {key: statistics.median(run[key] for run in runs)
                 for key in ("imported", "first", "second", "sdpa_first")}
            firsts = ", ".join(f"{run['first']:.1f}" for run in runs)
            every = f"  ({firsts})" if repeat > 1 else ""
            print(f"{label:40} {r['imported']:6.1f}s {r['first']:11.1f}s {r['second']:6.2f}s {r['sdpa_first']:8.2f}s "
                  f"{'yes' if r['first'] <= 5 else 'NO':>7}{every}", flush=True)


def default_against_autotuned():
    setting = ("bfloat16", 128, 1, 4, 32, 8192, 1)
    print("\n## default against autotuned: bf16, causal, D=128, B=4, H=32, N=8192 (128 heads x 8192)")
    print(f"{'run':44} {'1st call':>9} {'fwd ms':>8} {'bwd ms':>8} {'fwd+bwd':>8} {'vs tuned':>9}")
    for extra in ({}, {"FLASHATTN_GLUON": "0"}):
        with tempfile.TemporaryDirectory() as kept:
            tune = {**extra, "FLASHATTN_AUTOTUNE": "1"}
            rows = [("default (nothing timed)", child(setting, extra)),
                    ("FLASHATTN_AUTOTUNE=1 (tunes)", child(setting, tune, kept)),
                    ("FLASHATTN_AUTOTUNE=1, kept from the run above", child(setting, tune, kept))]
        tuned = rows[1][1]
        for label, r in rows:
            label += " GLUON=0" if extra else ""
            if "error" in r:
                print(f"{label:44} ERROR {r['error']}")
                continue
            total = r["fwd_ms"] + r["bwd_ms"]
            ratio = (tuned["fwd_ms"] + tuned["bwd_ms"]) / total if "fwd_ms" in tuned else float("nan")
            print(f"{label:44} {r['first']:8.1f}s {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {total:8.3f} {ratio:8.3f}x",
                  flush=True)
    print("(vs tuned: the autotuned fwd+bwd time over this row's; the target for the default row is >= 0.95)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only the first-call table")
    p.add_argument("--timeline", action="store_true", help="only where a first call's seconds go")
    p.add_argument("--repeat", type=int, default=1,
                   help="fresh processes per first-call setting (the median is shown)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as bytecode:
        os.environ["PYTHONPYCACHEPREFIX"] = bytecode  # the children's compiled bytecode,
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # written by the first
        child(("bfloat16", 128, 1, 1, 2, 128, 0), {})  # throwaway: fills it
        if args.timeline:
            return timeline()
        first_calls(args.repeat)
        if not args.quick:
            default_against_autotuned()


if __name__ == "__main__":
    main()
