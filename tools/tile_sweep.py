"""On a GPU: time tile configurations of the attention kernels, with what each costs to compile.

    python tools/tile_sweep.py                          # float32 'highest' (IEEE), head dims 64 and 128
    python tools/tile_sweep.py --head-dims 128 --kernels bwd_dkdv --out sweep.csv
    python tools/tile_sweep.py --only fwd:128:16x16w8s1 bwd_dq:64:32x16w4s2 ...

A default configuration is paid for twice: in the kernel's speed, and in the seconds its compile
adds to the first call at a new setting. This tool measures both, for each candidate of each
kernel (by default every float32 IEEE candidate of ``flashattn.gpu.configs``; ``--configs grid``, a
wider grid; ``--only``, the configurations named):

* ``compile_s``: the kernel's compile for this GPU (``flashattn.measure.compiled.compile_kernel``, which
  Triton's cache does not short-cut: its cache is empty), from Triton's IR to the GPU binary. A
  first call waits for that plus loading the kernel and, once per process and signature, building
  its launcher with the C compiler;
* ``regs``, ``spills``: registers per thread and bytes spilled per thread in that binary; a
  configuration that spills is not timed;
* ``ms``: the forward (kernel ``fwd``) or the whole backward (the others, with that one kernel's
  configuration set and the other two at their defaults), median of ``triton.testing.do_bench``;
* ``sdpa_ms``: PyTorch's SDPA on the same inputs in the same run, and the ratio;
* ``ok``: the configuration's results on a ragged causal shape (113 queries, 241 keys) against a
  float64 reference, by the rule of ``flashattn.testing.rule.judge``.

Each head dim and kernel's rows are printed fastest first. Compiles run one at a time, in this
process, so that ``compile_s`` is what a first call on this machine waits for one kernel.
"""
import argparse
import csv
import datetime
import itertools
import os
import sys
import tempfile
import time

# An empty Triton cache, before Triton is imported: every configuration compiles here.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tile-sweep-")
os.environ["FLASHATTN_AUTOTUNE"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from flashattn.gpu import configs
from flashattn.measure import compiled  # noqa: E402
from flashattn.kernels.backward import attention_backward  # noqa: E402
from flashattn.kernels.forward import attention_forward  # noqa: E402
from flashattn.measure.gpu_checks import _references  # noqa: E402
from flashattn.testing.rule import judge  # noqa: E402

KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
FIELDS = ["gpu", "torch", "triton", "date", "dtype", "precision", "head_dim", "causal", "batch", "heads",
          "seq_len", "kernel", "BLOCK_Q", "BLOCK_KV", "num_warps", "num_stages", "regs", "spills", "compile_s", "ms",
          "sdpa_ms", "sdpa_over_ms", "ok"]
#: --precision -> the kernels' dot precision; "tf32x3" is 'highest' with FLASHATTN_TF32X3=1
PRECISIONS = {"highest": "ieee", "high": "tf32", "tf32x3": "tf32x3"}


def grid(name, block_d, precision):
    """A wider set than the candidate lists: tiles of 16-64 rows, 2-8 warps, 1-2 stages, pruned by
    the rules of ``configs.fits`` on the running GPU (float32)."""
    fitting = []
    for bq, bkv, warps, stages in itertools.product((16, 32, 64), (16, 32, 64), (2, 4, 8), (1, 2)):
        config = triton.Config({"BLOCK_Q": bq, "BLOCK_KV": bkv}, num_warps=warps, num_stages=stages)
        if configs.fits(name, config, block_d, 4, precision):
            fitting.append(config)
    return fitting


def parse_only(specs):
    """``KERNEL:HEAD_DIM:BQxBKVwWARPSsSTAGES`` strings -> {(kernel, head dim): [Config, ...]}."""
    chosen = {}
    for spec in specs:
        name, d, tiles = spec.split(":")
        bq, rest = tiles.split("x")
        bkv, rest = rest.split("w")
        warps, stages = rest.split("s")
        config = triton.Config({"BLOCK_Q": int(bq), "BLOCK_KV": int(bkv)}, num_warps=int(warps),
                               num_stages=int(stages))
        chosen.setdefault((name, int(d)), []).append(config)
    return chosen


def run(q, k, v, do, causal, name, config):
    """The forward (``name == "fwd"``) or the backward with ``config`` for kernel ``name``."""
    d = q.shape[-1]
    if name == "fwd":
        return lambda: attention_forward(q, k, v, causal, d ** -0.5, config=config)
    o, lse2 = attention_forward(q, k, v, causal, d ** -0.5)
    return lambda: attention_backward(q, k, v, o, lse2, do, causal, d ** -0.5, configs={name: config})


def compile_time(name, config, block_d, causal, precision):
    """Seconds to compile ``name`` with ``config`` for the running GPU, its registers and spills."""
    constexprs = dict(config.kwargs, HEAD_DIM=block_d, BLOCK_D=block_d, IS_CAUSAL=causal,
                      DOT_PRECISION=precision)
    major, minor = torch.cuda.get_device_capability()
    start = time.perf_counter()
    kernel = compiled.compile_kernel(name, "fp32", constexprs, num_warps=config.num_warps,
                                     num_stages=config.num_stages, target=compiled.target(10 * major + minor))
    seconds = time.perf_counter() - start
    regs, spills, _ = compiled.resources(kernel)
    return seconds, regs, spills


def check(name, config, d, causal, refs, inputs):
    """Whether ``config`` gives results within the rule on the ragged shape."""
    q, k, v, do = inputs
    kw = dict(config=config) if name == "fwd" else {}
    o, lse2 = attention_forward(q, k, v, causal, d ** -0.5, **kw)
    dq, dk, dv = attention_backward(q, k, v, o, lse2, do, causal, d ** -0.5,
                                    configs=None if name == "fwd" else {name: config})
    ours = dict(out=o, dq=dq, dk=dk, dv=dv)
    checks = judge(ours, *[{key: ref[key] for key in ours} for ref in refs], q.dtype, do.abs().max().item())
    return all(c.ok for c in checks)


def sdpa_time(q, k, v, do, causal, name):
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if name == "fwd":
        return triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=causal), return_mode="median")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = sdpa(*leaves, is_causal=causal)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
                                   return_mode="median")


def sweep(name, candidates, inputs, small, refs, causal, precision):
    """Compile, check and time each configuration of kernel ``name``: a list of CSV rows (their
    configuration and measurements)."""
    q, k, v, do = inputs
    d, found = q.shape[-1], []
    for config in candidates:
        cfg = configs.as_dict(config)
        try:
            compile_s, regs, spills = compile_time(name, config, configs.block_d(d), causal, precision)
            ok = check(name, cfg, d, causal, refs, small)
            ms = float("nan") if spills else triton.testing.do_bench(run(q, k, v, do, causal, name, cfg),
                                                                      return_mode="median")
        except Exception as error:  # report it and go on to the next configuration
            print(f"  {name} {cfg}: {type(error).__name__}: {str(error).splitlines()[0][:160]}", flush=True)
            continue
        found.append(dict(cfg, regs=regs, spills=spills, compile_s=round(compile_s, 2), ms=round(ms, 4), ok=int(ok)))
    return found


def show(name, rows, default):
    """One kernel's rows, fastest first (those that spill last), the default marked."""
    default = configs.as_dict(default)
    print(f"  {name:8} {'config':22} {'regs':>4} {'spills':>6} {'compile s':>9} {'ms':>8} {'SDPA/ours':>9}  ok",
          flush=True)
    for row in sorted(rows, key=lambda r: (r["spills"] > 0, r["ms"])):
        cfg = f"{row['BLOCK_Q']}x{row['BLOCK_KV']} w{row['num_warps']} s{row['num_stages']}"
        mark = " (default)" if all(row[key] == default.get(key) for key in default) else ""
        print(f"  {name:8} {cfg + mark:22} {row['regs']:4} {row['spills']:6} {row['compile_s']:9.2f} "
              f"{row['ms']:8.3f} {row['sdpa_over_ms']:9.3f}  {'yes' if row['ok'] else 'NO'}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="highest", choices=sorted(PRECISIONS),
                        help="torch.set_float32_matmul_precision: 'highest' is IEEE float32, 'high' TF32; "
                             "'tf32x3' is 'highest' as 3xTF32 (FLASHATTN_TF32X3=1)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--configs", default="candidates", choices=["candidates", "grid"],
                        help="the kernel's candidate list, or a wider grid")
    parser.add_argument("--only", nargs="+", default=None, metavar="KERNEL:D:BQxBKVwWsS",
                        help="time these configurations only (and their kernels and head dims)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--out", default=None, help="CSV file to write")
    args = parser.parse_args(argv)

    if args.precision == "tf32x3":
        os.environ["FLASHATTN_TF32X3"] = "1"
    torch.set_float32_matmul_precision("highest" if args.precision == "tf32x3" else args.precision)
    precision, dtype, causal = PRECISIONS[args.precision], torch.float32, bool(args.causal)
    versions = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat())
    print(f"{versions['gpu']}, torch {versions['torch']}, triton {versions['triton']}, {versions['date']}; "
          f"float32 '{args.precision}' ({precision}), B={args.batch} H={args.heads} N={args.seq_len} "
          f"causal={int(causal)}", flush=True)
    rows = []
    only = parse_only(args.only) if args.only else None
    head_dims = sorted({d for _, d in only}) if only else args.head_dims
    for d in head_dims:
        block_d = configs.block_d(d)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(args.batch, args.heads, args.seq_len, d, device="cuda", generator=g)
                       for _ in range(4))
        small = [torch.randn(1, 2, n, d, device="cuda", generator=g) for n in (113, 241, 241, 113)]
        refs = _references(*small[:3], small[3], causal)
        print(f"\nhead dim {d}", flush=True)
        for name in args.kernels:
            if only is not None:
                candidates = only.get((name, d), [])
            elif args.configs == "grid":
                candidates = grid(name, block_d, precision)
            else:
                candidates = configs.candidates(name, dtype, precision)
            if not candidates:
                continue
            rejected = [c for c in candidates if not configs.fits(name, c, block_d, 4, precision)]
            for config in rejected:
                print(f"  {name} {configs.as_dict(config)}: not timed, configs.fits rejects it", flush=True)
            candidates = [c for c in candidates if c not in rejected]
            found = sweep(name, candidates, (q, k, v, do), small, refs, causal, precision)
            sdpa_ms = sdpa_time(q, k, v, do, causal, name)
            for row in found:
                row.update(versions, dtype="fp32", precision=args.precision, head_dim=d, causal=int(causal),
                           batch=args.batch, heads=args.heads, seq_len=args.seq_len, kernel=name,
                           sdpa_ms=round(sdpa_ms, 4), sdpa_over_ms=round(sdpa_ms / row["ms"], 3))
            show(name, found, configs.default_config(name, dtype, precision, block_d))
            rows += found
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
