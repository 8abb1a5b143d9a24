"""On a GPU: how long the first call takes, and what the default configurations cost against autotuned ones.

    python tools/first_call.py            # about 3 minutes on an H200
    python tools/first_call.py --quick    # the first-call table only

Every measurement runs in a fresh Python process with an empty Triton cache (``TRITON_CACHE_DIR``)
and an empty flashattn cache (``FLASHATTN_CACHE_DIR``), as a new user's first run would:

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
print("RESULT " + json.dumps(result))
"""


def child(setting, env_extra, cache=None):
    """Run one measurement in a fresh process; returns its result dict (or the error text)."""
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as own_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "FLASHATTN_CACHE_DIR": cache or own_cache}
        env.pop("FLASHATTN_AUTOTUNE", None)
        env.update(env_extra)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, setting)], env=env, capture_output=True,
                              text=True, timeout=900)
        wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), wall=wall)
    return dict(error=(proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"], wall=wall)


def first_calls():
    import torch

    print(f"## first call in a fresh process, empty caches ({torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {__import__('triton').__version__})")
    print(f"{'setting':40} {'import':>7} {'1st fwd+bwd':>12} {'2nd':>7} {'SDPA 1st':>9} {'<= 5 s':>7}")
    settings = [("bfloat16", 128, 1, 2, 16, 2048), ("float16", 64, 0, 2, 16, 2048), ("bfloat16", 96, 1, 2, 16, 1000),
                ("float16", 256, 0, 1, 8, 1024), ("float32", 128, 1, 2, 8, 1024), ("bfloat16", 64, 1, 1, 8, 777)]
    for extra in ({}, {"FLASHATTN_GLUON": "0"}):
        for dtype, d, causal, b, h, n in settings:
            label = f"{dtype} D={d} {'causal' if causal else 'full'} {b}x{h}x{n}" + (" GLUON=0" if extra else "")
            r = child((dtype, d, causal, b, h, n, 0), extra)
            if "error" in r:
                print(f"{label:40} ERROR {r['error']}")
                continue
            print(f"{label:40} {r['imported']:6.1f}s {r['first']:11.1f}s {r['second']:6.2f}s {r['sdpa_first']:8.2f}s "
                  f"{'yes' if r['first'] <= 5 else 'NO':>7}", flush=True)


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
    args = p.parse_args()
    first_calls()
    if not args.quick:
        default_against_autotuned()


if __name__ == "__main__":
    main()
