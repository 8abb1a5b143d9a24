"""Benchmark one decoding step of ``flashattn.decode`` against SDPA and the copy bandwidth, on a GPU.

    python -m flashattn.measure.bench_decode                 # caches of 4k, 16k and 64k tokens
    python -m flashattn.measure.bench_decode --host-ab       # decode's host work, each way timed
    python -m flashattn.measure.bench_decode --paged         # a paged cache (pages of 16, 64, 256)
    python -m flashattn.measure.bench_decode --paged --quick # the same, tiny, on the interpreter

See :func:`main` for the providers and what each column measures.
"""
import argparse
import csv
import datetime
import math
import os
import sys

import torch

from ..kernels import decode as kernel_decode
from ..ops import decode as op_decode
from .bench import DTYPES


DECODE_FIELDS = ["gpu", "torch", "triton", "dtype", "batch", "heads", "kv_heads", "n_q", "head_dim",
                 "cache_len", "provider", "num_splits", "ms", "cache_tbps", "of_copy", "loop_ms", "host_us"]


def copy_bandwidth(nbytes=2 * 2**30, device="cuda"):
    """The device's measured copy bandwidth, TB/s: one large device-to-device copy, bytes read
    plus bytes written per second (the most a kernel that streams memory can hope for)."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / ms * 1e-9


def loop_time(fn, calls=100, rounds=5):
    """A decoding step as a generation loop runs it: ``calls`` calls back to back, then one wait for
    the GPU. Returns the wall time per call in ms (the kernels' time, or the host's when the host
    takes longer to launch them) and the host's time per call in us (until the last launch
    returns, before the wait). Best of ``rounds``; 100 calls stay within CUDA's launch queue."""
    import time

    fn()
    best_wall = best_host = math.inf
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        best_host = min(best_host, (launched - start) / calls)
        best_wall = min(best_wall, (done - start) / calls)
    return best_wall * 1e3, best_host * 1e6


def decode_inputs(batch, heads, kv_heads, n, head_dim, dtype, device):
    """``(q, k_cache, v_cache, cache_seqlens)`` of one decoding step the benchmarks time: one new
    token per sequence against full caches of ``n`` keys (seeded), the lengths on the CPU."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, n, head_dim, device=device, generator=g).to(dtype)
            for _ in range(2))
    return q, k, v, torch.full((batch,), n, dtype=torch.int32)


def decode_providers(q, k, v, lengths):
    """What a decoding step is compared with, on the same cache: name -> callable. The two decode
    providers call ``flashattn.decode`` as a user does (every check, the lengths read anew)."""
    import flashattn
    from torch.nn.functional import scaled_dot_product_attention

    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))  # plain attention's shapes
    on_gpu = lengths.to(q.device)
    longest = int(lengths.max())
    return {
        "decode": lambda: flashattn.decode(q, k, v, lengths),         # lengths on the CPU
        "decode-gpu-lengths": lambda: flashattn.decode(q, k, v, on_gpu),  # checked with a sync
        "sdpa-gqa": lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "attention-repeated": lambda: flashattn.attention(q, k_rep, v_rep),
        # a generation loop captured in a CUDA graph: each step a replay, no host work but the launch
        "decode-graph": graphed(lambda: flashattn.decode(q, k, v, on_gpu, max_seqlen=longest)),
        "sdpa-gqa-graph": graphed(lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True)),
    }


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call outside it): returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_sweep(q, k, v, lengths, log=print):
    """Time every decode configuration (configs.DECODE_CANDIDATES) with 1, 2, 4 and 8 programs
    per SM aimed at by the split heuristic. Returns {(candidate, programs_per_sm): (splits, ms)}."""
    import triton

    from ..gpu import configs
    from ..kernels.decode import choose_num_splits, decode_forward, sm_count

    batch, heads, n_q, head_dim = q.shape
    length = int(lengths.max())
    on_gpu = lengths.to(q.device)
    times = {}
    for candidate in configs.DECODE_CANDIDATES:
        config = configs.decode_config(q.dtype, "ieee", 16, configs.block_d(head_dim), candidate)
        for per_sm in (1, 2, 4, 8):
            splits = choose_num_splits(batch * k.shape[1], length - n_q + 1, config["BLOCK_KV"],
                                       sm_count(q.device), per_sm)
            if any(s == splits for (c, _), (s, _) in times.items() if c == candidate):
                continue  # the same launch as a smaller programs_per_sm
            ms = triton.testing.do_bench(lambda: decode_forward(q, k, v, on_gpu, length, 0.1, splits, config),
                                         return_mode="median")
            times[(candidate, per_sm)] = (splits, ms)
    return times


def decode_run(lengths, batch, heads, kv_heads, head_dim, dtype, out_csv, sweep=True, log=print,
               device="cuda", copy_bytes=2 * 2**30):
    """Time a decoding step (N_q = 1) at each cache length, side by side with SDPA and plain
    attention, against the copy bandwidth; write a CSV and print a table."""
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__)
    copy_tbps = copy_bandwidth(copy_bytes, device)
    log(f"copy bandwidth (device-to-device, read + write): {copy_tbps:.2f} TB/s")
    rows = []
    for n in lengths:
        q, k, v, cache_seqlens = decode_inputs(batch, heads, kv_heads, n, head_dim, dtype, device)
        cache_bytes = 2 * batch * kv_heads * n * head_dim * dtype.itemsize  # K and V, read once
        timed = {}
        for name, fn in decode_providers(q, k, v, cache_seqlens).items():
            fn()  # compile / warm up
            loop_ms, host_us = loop_time(fn)
            timed[name] = ("", triton.testing.do_bench(fn, return_mode="median"),
                           f"{loop_ms:.4f}", f"{host_us:.1f}")
        if sweep:
            for (candidate, per_sm), (splits, ms) in decode_sweep(q, k, v, cache_seqlens).items():
                timed[f"decode {candidate} x{per_sm}/SM"] = (splits, ms, "", "")
        for name, (splits, ms, loop_ms, host_us) in timed.items():
            tbps = cache_bytes / ms * 1e-9
            rows.append(dict(meta, dtype=str(dtype).replace("torch.", ""), batch=batch, heads=heads,
                             kv_heads=kv_heads, n_q=1, head_dim=head_dim, cache_len=n, provider=name,
                             num_splits=splits, ms=f"{ms:.4f}", cache_tbps=f"{tbps:.3f}",
                             of_copy=f"{tbps / copy_tbps:.3f}", loop_ms=loop_ms, host_us=host_us))
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(out_csv) or ".", exist_ok=True)
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=DECODE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows, copy_tbps


def decode_host_costs(batch=8, device="cuda", calls=200):
    """The host's time per call (us) of the steps of ``flashattn.decode`` that only a GPU can
    time: copying the lengths (through pinned memory and straight from pageable memory, decode's
    two ways), allocating an output, asking whether a CUDA graph is being captured. Each is timed on
    an idle GPU and behind 20 ms of queued work: a step that waits for the GPU's queue shows there.
    The busy round runs twice and the second counts (the first grows the pinned-memory pool: while
    the GPU is behind, every copy holds its own pinned buffer). Returns lines to print."""
    import time

    lens = torch.full((batch,), 4096, dtype=torch.int32)
    steps = {
        "lengths: pin_memory().to(cuda, non_blocking)": lambda: lens.pin_memory().to(device, non_blocking=True),
        "lengths: pageable .to(cuda, non_blocking)": lambda: lens.to(device, non_blocking=True),
        "torch.empty((B, 32, 1, 128)) on the GPU": lambda: torch.empty((batch, 32, 1, 128), device=device),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
    }
    lines = [f"host us per call of decode's steps (B = {batch}):  idle GPU   busy GPU"]
    for name, fn in steps.items():
        timed = []
        for busy in (False, True, True):
            fn()
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(40_000_000)  # ~20 ms of GPU clock cycles
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            timed.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
        del timed[1]
        lines.append(f"  {name:46} {timed[0]:8.1f} {timed[1]:10.1f}")
    return lines


HOST_AB_FIELDS = ["gpu", "torch", "triton", "dtype", "batch", "heads", "kv_heads", "head_dim", "cache_len",
                  "provider", "launch", "lengths", "buffers", "ms", "loop_ms", "host_us"]


def decode_host_ab(lengths, batch, heads, kv_heads, head_dim, dtype, out_csv, device="cuda",
                   profile_calls=200):
    """decode's ways of doing its host work (``decode.HOST_CHOICES``: launching, copying the
    lengths, allocating), switched in this process and timed at each cache length next to SDPA:
    do_bench's ms, loop_ms and host_us as ``decode_run`` measures them. ``kernels only`` is
    decode's plan launching, its default ways, on lengths already on the GPU (no checks, no copy).
    Then cProfile's tables of ``profile_calls`` calls back to back at the first length, decode's
    default ways. Writes a CSV; returns lines to print."""
    import cProfile
    import itertools
    import pstats

    import triton
    from torch.nn.functional import scaled_dot_product_attention

    import flashattn

    default = dict(kernel_decode.HOST)
    ways = [dict(zip(kernel_decode.HOST_CHOICES, combo))
            for combo in itertools.product(*kernel_decode.HOST_CHOICES.values())]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                dtype=str(dtype).replace("torch.", ""), batch=batch, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim)
    rows, lines, profiled = [], [], []
    try:
        for n in lengths:
            q, k, v, lens = decode_inputs(batch, heads, kv_heads, n, head_dim, dtype, device)
            on_gpu = lens.to(device)
            expected = flashattn.decode(q, k, v, lens)  # decode's default ways; the others must match it
            plan = op_decode.plan_for(q, k, v, lens)
            timed = [("decode", way, lambda: flashattn.decode(q, k, v, lens)) for way in ways]
            timed += [("kernels only", default, lambda: plan.run(q, k, v, on_gpu, n, plan.scale, keep_lse=False)),
                      ("sdpa-gqa", {}, lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True))]
            lines.append(f"cache {n}:  {'provider':13} {'launch':9} {'lengths':9} {'buffers':9} {'ms':>8} "
                         f"{'loop us':>8} {'host us':>8}")
            for name, way, fn in timed:
                kernel_decode.set_host(**(way or default))
                fn()  # compile / warm up
                loop_ms, host_us = loop_time(fn)
                ms = triton.testing.do_bench(fn, return_mode="median")
                rows.append(dict(meta, cache_len=n, provider=name, launch=way.get("launch", ""),
                                 lengths=way.get("lengths", ""), buffers=way.get("buffers", ""), ms=f"{ms:.4f}",
                                 loop_ms=f"{loop_ms:.4f}", host_us=f"{host_us:.1f}"))
                mark = "*" if name == "decode" and way == default else " "
                differs = name == "decode" and not torch.equal(fn(), expected)
                lines.append(f"{'':11}{mark} {name:13} {way.get('launch', ''):9} {way.get('lengths', ''):9} "
                             f"{way.get('buffers', ''):9} {ms:8.4f} {loop_ms * 1e3:8.1f} {host_us:8.1f}"
                             + ("  OUTPUT DIFFERS from the default's" if differs else ""))
            if not profiled:
                kernel_decode.set_host(**default)
                profile = cProfile.Profile()
                torch.cuda.synchronize()
                profile.enable()
                for _ in range(profile_calls):
                    flashattn.decode(q, k, v, lens)
                profile.disable()
                torch.cuda.synchronize()
                stats = pstats.Stats(profile).stats  # (file, line, name) -> (_, calls, own s, cumulative s, _)
                for order, column in (("cumulative", 3), ("own", 2)):
                    profiled.append(f"cProfile of {profile_calls} decode calls back to back at cache {n}, by "
                                    f"{order} time (us per decode call):\n{'calls':>7} {'own us':>8} {'cum us':>8}")
                    for (file, line, func), entry in sorted(stats.items(), key=lambda e: -e[1][column])[:15]:
                        profiled.append(f"{entry[1]:7d} {entry[2] / profile_calls * 1e6:8.2f} "
                                        f"{entry[3] / profile_calls * 1e6:8.2f}  {os.path.basename(file)}:{line}({func})")
            del q, k, v, plan, timed, expected
            torch.cuda.empty_cache()
    finally:
        kernel_decode.set_host(**default)
    lines.append("* decode's default ways; ms: do_bench's median; loop us: a call's share of 100 calls back "
                 "to back; host us: the host's time per call in that loop")
    os.makedirs(os.path.dirname(out_csv) or ".", exist_ok=True)
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HOST_AB_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return lines + profiled


PAGED_FIELDS = ["gpu", "torch", "triton", "dtype", "batch", "heads", "kv_heads", "n_q", "head_dim", "cache_len",
                "page_size", "provider", "ms", "cache_tbps", "of_contiguous", "max_diff"]


def paged_inputs(k, v, page_size, seed=0):
    """The caches ``k``, ``v`` (B, H_kv, N, D) cut into pages of ``page_size`` rows (the last one
    padded with zeros) and stored in a shuffled order, FlashAttention's paged layout: returns
    ``(k_pages, v_pages, block_table)``, pages ``(B * max_blocks, page_size, H_kv, D)``."""
    batch, kv_heads, n, head_dim = k.shape
    blocks = -(-n // page_size)
    g = torch.Generator(device=k.device).manual_seed(seed)
    order = torch.randperm(batch * blocks, device=k.device, generator=g)  # logical page -> physical page
    paged = []
    for t in (k, v):
        padded = torch.zeros(batch, kv_heads, blocks * page_size, head_dim, device=t.device, dtype=t.dtype)
        padded[:, :, :n] = t
        logical = padded.transpose(1, 2).reshape(batch * blocks, page_size, kv_heads, head_dim)
        pages = torch.empty_like(logical)
        pages[order] = logical
        paged.append(pages)
    return paged[0], paged[1], order.view(batch, blocks).to(torch.int32)


def paged_run(lengths, page_sizes, batch, heads, kv_heads, head_dim, dtype, out_csv, quick=False, log=print):
    """Time a decoding step (N_q = 1) on a paged cache at each cache length and page size, side by
    side with flashattn.decode on the contiguous cache and SDPA on the gathered (contiguous) cache,
    and SDPA with the gather in the step (what a paged cache costs SDPA); on a GPU both decodes also
    captured in CUDA graphs (no host work). Each paged output is checked against the contiguous one
    first. Writes a CSV; returns its rows."""
    import triton
    from torch.nn.functional import scaled_dot_product_attention

    import flashattn
    from ..testing.reference import gather_pages
    from .variants import time_ms

    device = flashattn.DEVICE
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, dtype=str(dtype).replace("torch.", ""),
                batch=batch, heads=heads, kv_heads=kv_heads, n_q=1, head_dim=head_dim)
    rows = []
    with torch.inference_mode():
        for n in lengths:
            q, k, v, lens = decode_inputs(batch, heads, kv_heads, n, head_dim, dtype, device)
            cache_bytes = 2 * batch * kv_heads * n * head_dim * dtype.itemsize  # K and V, read once
            contiguous = flashattn.decode(q, k, v, lens)
            base_ms = time_ms(lambda: flashattn.decode(q, k, v, lens), quick)
            on_gpu = lens.to(device)
            timed = [("", "decode", base_ms, ""),
                     ("", "sdpa-gqa", time_ms(lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                              quick), "")]
            if device.type == "cuda":  # captured in a CUDA graph: the kernels alone, no host work
                timed.append(("", "decode-graph", time_ms(graphed(
                    lambda: flashattn.decode(q, k, v, on_gpu, max_seqlen=n)), quick), ""))
            for page_size in page_sizes:
                k_pages, v_pages, table = paged_inputs(k, v, page_size)
                out = flashattn.decode(q, k_pages, v_pages, lens, block_table=table)
                diff = (out.float() - contiguous.float()).abs().max().item()
                if not diff <= 1e-2:  # the same tiles in the same order: rounding at most
                    raise AssertionError(f"paged decode (pages of {page_size}) differs from decode by {diff}")
                timed.append((page_size, "decode-paged", time_ms(
                    lambda: flashattn.decode(q, k_pages, v_pages, lens, block_table=table), quick), f"{diff:.3g}"))
                if device.type == "cuda":
                    timed.append((page_size, "decode-paged-graph", time_ms(graphed(
                        lambda: flashattn.decode(q, k_pages, v_pages, on_gpu, max_seqlen=n, block_table=table)),
                        quick), ""))

                def gather_then_sdpa():
                    k_flat, v_flat = gather_pages(k_pages, table), gather_pages(v_pages, table)
                    return scaled_dot_product_attention(q, k_flat[:, :, :n], v_flat[:, :, :n], enable_gqa=True)

                timed.append((page_size, "sdpa-gqa-gather", time_ms(gather_then_sdpa, quick), ""))
            for page_size, provider, ms, diff in timed:
                tbps = cache_bytes / ms * 1e-9
                rows.append(dict(meta, cache_len=n, page_size=page_size, provider=provider, ms=f"{ms:.4f}",
                                 cache_tbps=f"{tbps:.3f}", of_contiguous=f"{ms / base_ms:.3f}", max_diff=diff))
                log(f"cache {n:6} pages {page_size or '-':>4}  {provider:16} {ms:9.4f} ms  {tbps:6.2f} TB/s  "
                    f"x{ms / base_ms:5.2f} of contiguous decode")
            del q, k, v, k_pages, v_pages
            if device.type == "cuda":
                torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(out_csv)), exist_ok=True)
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PAGED_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def decode_summary(rows):
    """Per cache length: each provider's time, cache TB/s, fraction of the copy bandwidth, and
    decode's speed-up over it, then its time per call in a loop and the host's share of it (where
    measured); then the fastest configurations of the sweep."""
    lines = []
    for n in sorted({int(r["cache_len"]) for r in rows}):
        sel = [r for r in rows if int(r["cache_len"]) == n]
        ours = next(float(r["ms"]) for r in sel if r["provider"] == "decode")
        lines.append(f"cache {n}:  {'provider':34} {'ms':>8} {'TB/s':>6} {'of copy':>7} {'decode is':>9}"
                     f" {'loop us':>8} {'host us':>8}")
        main_rows = [r for r in sel if not r["provider"].startswith("decode ")]
        swept = sorted((r for r in sel if r["provider"].startswith("decode ")), key=lambda r: float(r["ms"]))
        for r in main_rows + swept[:3]:
            ms = float(r["ms"])
            label = r["provider"] + (f" ({r['num_splits']} splits)" if r["num_splits"] else "")
            loop = f"{float(r['loop_ms']) * 1e3:8.1f}" if r.get("loop_ms") else f"{'-':>8}"
            host = f"{float(r['host_us']):8.1f}" if r.get("host_us") else f"{'-':>8}"
            lines.append(f"{'':12} {label:34} {ms:8.4f} {float(r['cache_tbps']):6.2f} "
                         f"{float(r['of_copy']):7.0%} {ms / ours:8.2f}x {loop} {host}")
    return lines


def main(argv=None):
    """``python -m flashattn.measure.bench_decode``: one decoding step (N_q = 1) against caches of the
    given lengths, at B = 8, H_q = 32, H_kv = 8, D = 128, bf16 by default. Providers:

    * ``decode``: flashattn.decode, lengths passed on the CPU (its fast path);
    * ``decode-gpu-lengths``: the same with the lengths on the GPU (checking them synchronises);
    * ``sdpa-gqa``: scaled_dot_product_attention(q, k, v, enable_gqa=True), its default backend;
    * ``attention-repeated``: flashattn.attention with K and V repeated to H_q heads;
    * ``decode-graph``, ``sdpa-gqa-graph``: ``decode`` (lengths on the GPU, ``max_seqlen``) and
      ``sdpa-gqa`` captured in a CUDA graph, timed by replaying it, as a captured generation loop runs;
    * ``decode (BLOCK_KV, warps, stages) xP/SM``: every candidate configuration, the split
      heuristic aiming at P programs per SM (the three fastest are printed, all go to the CSV),
      launched by ``decode.decode_forward`` on lengths already on the GPU: the kernels alone.

    ``ms`` is triton.testing.do_bench's median, which empties the L2 cache before each call: the
    GPU's work of a call, plus whatever host work before the first launch outlasts that emptying.
    ``loop_ms`` is a call's share of 100 calls back to back, as a generation loop makes them (the
    kernels' time, or the host's when launching takes longer), and ``host_us`` the host's time per
    call in that loop. TB/s counts the bytes of the K/V cache (2 x B x H_kv x L x D x 2 bytes),
    whatever a provider actually reads (plain attention reads H_q / H_kv times more), against the
    copy bandwidth.

    ``--host-ab`` times, instead, decode's ways of doing its host work side by side (how it
    launches, copies the lengths and allocates: ``decode_host_ab``), with a cProfile of decode.

    ``--paged`` times, instead, ``decode-paged`` (flashattn.decode on a paged cache, pages of each
    ``--page-sizes`` in shuffled order, ``block_table``) next to ``decode`` on the contiguous cache,
    ``sdpa-gqa`` on the contiguous (gathered) cache and ``sdpa-gqa-gather`` (the gather inside the
    step), and ``decode-graph``, ``decode-paged-graph`` captured in CUDA graphs: ``paged_run``.
    ``--quick`` runs it tiny, on the interpreter too.
    """
    p = argparse.ArgumentParser(prog="python -m flashattn.measure.bench_decode", description=main.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--no-sweep", action="store_true", help="skip timing every candidate configuration")
    p.add_argument("--host-ab", action="store_true",
                   help="instead: time decode's ways of doing its host work side by side (decode_host_ab)")
    p.add_argument("--paged", action="store_true",
                   help="instead: decode on a paged KV cache against the contiguous one and SDPA (paged_run)")
    p.add_argument("--page-sizes", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--quick", action="store_true", help="with --paged: tiny sizes (runs on the interpreter)")
    p.add_argument("--out", help="the CSV (default figures/data/decode.csv, decode_host_ab.csv or decode_paged.csv)")
    args = p.parse_args(argv)
    if args.paged:
        out = args.out or os.path.join("figures", "data", "decode_paged.csv")
        if args.quick:
            paged_run([40, 69], [16, 32], 2, 4, 2, 16, torch.float16, out, quick=True)
        elif torch.cuda.is_available():
            paged_run(args.lengths, args.page_sizes, args.batch, args.heads, args.kv_heads, args.head_dim,
                      DTYPES[args.dtype], out)
        else:
            sys.exit("flashattn.measure.bench_decode --paged times on a CUDA GPU; on a CPU add --quick")
        print("wrote", out)
        return
    if not torch.cuda.is_available():
        sys.exit("flashattn.measure.bench_decode needs a CUDA GPU.")
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.host_ab:
        out = args.out or os.path.join("figures", "data", "decode_host_ab.csv")
        print("\n".join(decode_host_ab(args.lengths, args.batch, args.heads, args.kv_heads, args.head_dim,
                                       DTYPES[args.dtype], out)))
        print("\n".join(decode_host_costs(args.batch)))
        print("wrote", out)
        return
    args.out = args.out or os.path.join("figures", "data", "decode.csv")
    rows, _ = decode_run(args.lengths, args.batch, args.heads, args.kv_heads, args.head_dim,
                         DTYPES[args.dtype], args.out, sweep=not args.no_sweep)
    print("\n".join(decode_summary(rows)))
    print("\n".join(decode_host_costs(args.batch)))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
