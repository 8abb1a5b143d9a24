"""Benchmark the attention variants on a GPU: packed sequences, grouped-query attention, sliding
windows, each next to what it replaces, in bfloat16.

    python -m flashattn.measure.variants --out-dir DIR       # on a GPU: three CSVs, about 2 minutes
    python -m flashattn.measure.variants --quick --out-dir DIR   # tiny sizes, runs on the interpreter

It writes, side by side from one run:

* ``variants_varlen.csv``: a batch of 32 sequences whose lengths are drawn (seeded) between 100
  and 8000 tokens, 32 heads, head dim 128, causal. ``flashattn-varlen`` (packed, no padding)
  against ``flashattn-padded`` (the same kernels on the batch padded to its longest sequence) and
  ``sdpa-padded`` (scaled_dot_product_attention's default on that padded batch). ``tokens_per_s``
  counts the real tokens only, ``tflops`` the real work (each sequence's causal FLOPs).
* ``variants_gqa.csv``: 32 query heads reading 8 K/V heads (``flashattn-gqa8``, ``sdpa-gqa8`` with
  enable_gqa) against the same attention with K/V repeated to 32 heads (``flashattn-mha32``,
  ``sdpa-mha32``), N = 8192, head dim 128, causal; ``kv_mib`` is the K and V a forward reads.
* ``variants_window.csv``: a causal sliding window of 4096 keys (``window_size=(4096, 0)``) against
  full causal attention (``flashattn-causal``, ``sdpa-causal``) at N = 4k, 8k, 16k, 32k, 16 heads:
  the window's time grows linearly in N, the causal one's quadratically.

Every mode is timed: ``fwd``, ``bwd`` (the backward alone) and ``fwd+bwd``, as the median of
``triton.testing.do_bench``. Before any timing, each shape's flashattn output is compared with
SDPA's (``max_diff``, the largest absolute difference; a difference over ``TOLERANCE`` stops the run).
"""
import argparse
import csv
import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import flashattn

FIELDS = ["gpu", "torch", "triton", "date", "bench", "setting", "provider", "mode", "ms",
          "tokens_per_s", "tflops", "kv_mib", "max_diff"]
MODES = ("fwd", "bwd", "fwd+bwd")
TOLERANCE = 0.05  # bfloat16 outputs of size ~1 differ from SDPA's by a few units of 2**-8

#: The sizes of the GPU run, and of ``--quick`` (the interpreter on a CPU).
SIZES = {
    "gpu": dict(batch=32, min_len=100, max_len=8000, varlen_heads=32, head_dim=128,
                heads_q=32, heads_kv=8, gqa_n=8192, window=4096, window_heads=16,
                window_ns=(4096, 8192, 16384, 32768)),
    "quick": dict(batch=3, min_len=5, max_len=40, varlen_heads=2, head_dim=16,
                  heads_q=4, heads_kv=2, gqa_n=48, window=16, window_heads=2, window_ns=(32, 64)),
}


def time_ms(fn, quick):
    """Median milliseconds of ``fn()``: triton's do_bench on a GPU, one timed call on the CPU."""
    if quick:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def timed_modes(forward, inputs, quick):
    """``{mode: ms}`` for ``forward()`` (a function of the leaves ``inputs``), its backward alone
    and both together."""
    out = forward()
    do = torch.randn_like(out)
    results = {"fwd": time_ms(lambda: forward(), quick)}
    results["bwd"] = time_ms(lambda: out.backward(do, retain_graph=True), quick)
    results["fwd+bwd"] = time_ms(lambda: forward().backward(do), quick)
    for t in inputs:
        t.grad = None
    return results


def max_diff(ours, theirs):
    diff = (ours.float() - theirs.float()).abs().max().item()
    if not diff <= TOLERANCE:
        raise AssertionError(f"flashattn differs from SDPA by {diff} (more than {TOLERANCE})")
    return diff


def visible_pairs(n, window=None):
    """Query/key pairs a causal attention over ``n`` tokens computes (query i sees keys
    ``max(i - window, 0) .. i``; all of ``0 .. i`` without a window)."""
    if window is None or n <= window + 1:
        return n * (n + 1) // 2
    return (window + 1) * (window + 2) // 2 + (n - window - 1) * (window + 1)


def causal_flops(n, heads, head_dim, window=None):
    """Forward FLOPs of causal attention: two matmuls over the visible pairs."""
    return 4.0 * heads * visible_pairs(n, window) * head_dim


def leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def bench_varlen(s, device, dtype, quick, rows, meta):
    rng = np.random.default_rng(0)
    lengths = rng.integers(s["min_len"], s["max_len"] + 1, size=s["batch"]).tolist()
    heads, head_dim, longest, total = s["varlen_heads"], s["head_dim"], max(lengths), sum(lengths)
    setting = (f"{s['batch']} sequences of {s['min_len']}..{s['max_len']} tokens (seed 0: {total} tokens, "
               f"longest {longest}), heads {heads}, D {head_dim}, {str(dtype)[6:]}, causal")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    # The padded batch (B, H, longest, D): sequence b in rows 0..n_b - 1, zeros after. Causal and
    # top-left aligned, its real queries see only real keys, so their outputs are the packed ones.
    padded = [torch.zeros(len(lengths), heads, longest, head_dim, device=device, dtype=dtype)
              for _ in range(3)]
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for dst, src in zip(padded, (q, k, v)):
            dst[b, :, : e - a] = src[a:e].transpose(0, 1)
    qv, kv_, vv = leaves(q, k, v)
    qp, kp, vp = leaves(*padded)
    providers = {
        "flashattn-varlen": (lambda: flashattn.varlen_attention(qv, kv_, vv, cu, cu, longest, longest,
                                                                is_causal=True), (qv, kv_, vv)),
        "flashattn-padded": (lambda: flashattn.attention(qp, kp, vp, is_causal=True), (qp, kp, vp)),
        "sdpa-padded": (lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True), (qp, kp, vp)),
    }
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(*padded, is_causal=True)
        ref_packed = torch.cat([ref[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
        diffs = {"flashattn-varlen": max_diff(providers["flashattn-varlen"][0](), ref_packed),
                 "flashattn-padded": max_diff(
                     torch.cat([o[:, :n].transpose(0, 1) for o, n in
                                zip(providers["flashattn-padded"][0](), lengths)]), ref_packed),
                 "sdpa-padded": 0.0}
    flops = sum(causal_flops(n, heads, head_dim) for n in lengths)
    for name, (forward, inputs) in providers.items():
        for mode, ms in timed_modes(forward, inputs, quick).items():
            work = flops * (1.0 if mode == "fwd" else 2.5 if mode == "bwd" else 3.5)
            rows.append(dict(meta, bench="varlen", setting=setting, provider=name, mode=mode,
                             ms=f"{ms:.4g}", tokens_per_s=f"{total / ms * 1e3:.4g}",
                             tflops=f"{work / ms / 1e9:.1f}", kv_mib="", max_diff=f"{diffs[name]:.3g}"))


def bench_gqa(s, device, dtype, quick, rows, meta):
    heads_q, heads_kv, n, head_dim = s["heads_q"], s["heads_kv"], s["gqa_n"], s["head_dim"]
    group = heads_q // heads_kv
    setting = f"batch 1, {heads_q} query heads, N {n}, D {head_dim}, {str(dtype)[6:]}, causal"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads_q, n, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(1, heads_kv, n, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))
    a = leaves(q, k, v)
    b = leaves(q, k_rep, v_rep)
    providers = {
        f"flashattn-gqa{heads_kv}": (lambda: flashattn.attention(*a, is_causal=True, enable_gqa=True), a),
        f"flashattn-mha{heads_q}": (lambda: flashattn.attention(*b, is_causal=True), b),
        f"sdpa-gqa{heads_kv}": (lambda: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True),
                                a),
        f"sdpa-mha{heads_q}": (lambda: F.scaled_dot_product_attention(*b, is_causal=True), b),
    }
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        diffs = {name: max_diff(fn(), ref) for name, (fn, _) in providers.items()}
    flops = causal_flops(n, heads_q, head_dim)
    for name, (forward, inputs) in providers.items():
        kv_heads = heads_kv if "gqa" in name else heads_q
        kv_mib = 2 * kv_heads * n * head_dim * q.element_size() / 2**20
        for mode, ms in timed_modes(forward, inputs, quick).items():
            work = flops * (1.0 if mode == "fwd" else 2.5 if mode == "bwd" else 3.5)
            rows.append(dict(meta, bench="gqa", setting=setting, provider=name, mode=mode, ms=f"{ms:.4g}",
                             tokens_per_s=f"{n / ms * 1e3:.4g}", tflops=f"{work / ms / 1e9:.1f}",
                             kv_mib=f"{kv_mib:.4g}", max_diff=f"{diffs[name]:.3g}"))


def bench_window(s, device, dtype, quick, rows, meta):
    heads, head_dim, window = s["window_heads"], s["head_dim"], s["window"]
    for n in s["window_ns"]:
        setting = f"batch 1, heads {heads}, D {head_dim}, {str(dtype)[6:]}, window ({window}, 0), N {n}"
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, n, head_dim, generator=g).to(device, dtype) for _ in range(3))
        a = leaves(q, k, v)
        providers = {
            "flashattn-window": (lambda: flashattn.attention(*a, window_size=(window, 0)), a),
            "flashattn-causal": (lambda: flashattn.attention(*a, is_causal=True), a),
            "sdpa-causal": (lambda: F.scaled_dot_product_attention(*a, is_causal=True), a),
        }
        with torch.no_grad():  # the last rows (those the window cuts most) against SDPA with the mask
            rows_checked = min(n, 1024)
            i = torch.arange(n - rows_checked, n, device=device)[:, None]
            j = torch.arange(n, device=device)[None, :]
            mask = (j <= i) & (j >= i - window)
            ref = F.scaled_dot_product_attention(q[:, :, -rows_checked:], k, v, attn_mask=mask)
            out = flashattn.attention(q, k, v, window_size=(window, 0))[:, :, -rows_checked:]
            diffs = {"flashattn-window": max_diff(out, ref),
                     "flashattn-causal": max_diff(flashattn.attention(q, k, v, is_causal=True),
                                                  F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     "sdpa-causal": 0.0}
        for name, (forward, inputs) in providers.items():
            flops = causal_flops(n, heads, head_dim, window if name == "flashattn-window" else None)
            for mode, ms in timed_modes(forward, inputs, quick).items():
                work = flops * (1.0 if mode == "fwd" else 2.5 if mode == "bwd" else 3.5)
                rows.append(dict(meta, bench="window", setting=setting, provider=name, mode=mode,
                                 ms=f"{ms:.4g}", tokens_per_s=f"{n / ms * 1e3:.4g}",
                                 tflops=f"{work / ms / 1e9:.1f}", kv_mib="", max_diff=f"{diffs[name]:.3g}"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="where the three CSVs go")
    p.add_argument("--quick", action="store_true", help="tiny sizes (runs on the interpreter)")
    args = p.parse_args(argv)
    quick = args.quick
    if not quick and flashattn.DEVICE.type != "cuda":
        sys.exit("bench_variants times kernels on a CUDA GPU; on a CPU run it with --quick")
    import triton
    s = SIZES["quick" if quick else "gpu"]
    device, dtype = flashattn.DEVICE, torch.bfloat16
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())
    os.makedirs(args.out_dir, exist_ok=True)
    paths = []
    for name, bench in (("varlen", bench_varlen), ("gqa", bench_gqa), ("window", bench_window)):
        rows = []
        start = time.perf_counter()
        bench(s, device, dtype, quick, rows, meta)
        path = os.path.join(args.out_dir, f"variants_{name}.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        paths.append(path)
        print(f"{name}: {len(rows)} rows in {time.perf_counter() - start:.0f} s -> {path}")
        setting = None
        for row in rows:
            if row["setting"] != setting:
                setting = row["setting"]
                print(f"  {setting}")
            print(f"    {row['provider']:>18} {row['mode']:>7} {row['ms']:>8} ms {row['tflops']:>7} TFLOPS "
                  f"{row['tokens_per_s']:>10} tokens/s  max_diff {row['max_diff']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return paths


if __name__ == "__main__":
    main()
