"""Check and time the backward on a Hopper GPU, in one run: the fused Gluon kernel (dK, dV and dQ
in one kernel, dQ by TMA reduce-adds; Triton >= 3.8) and the deterministic path (Gluon dK/dV,
Triton dQ), each against float64 under the rule, then both timed beside SDPA's cuDNN backend.

    python tools/backward_check.py                 # checks, the 24 cells of the sweep, grouped heads
    python tools/backward_check.py --quick         # bf16 only: checks, then N = 8192
    python tools/backward_check.py --csv OUT.csv   # also write the timings
    python tools/backward_check.py --no-checks --head-dims 64 --bwd-variants '[{"STAGES": 3}]'
                                                   # time configurations beside the default
    python tools/backward_check.py --check-variants --bwd-variants '[{"STAGES": 3}]'
                                                   # and check them (bf16) before
    python tools/backward_check.py --no-checks --head-dims 64 --seq-lens 16384 --causal 0 --batch-heads 1x64 4x32
                                                   # one cell at other batch x heads
    python tools/backward_check.py --check-variants --dtypes bf16 --head-dims 128 --seq-lens 4096 --causal 1 \
        --batch-heads 4x16 --kv-heads 4 --bwd-variants '[{"HEAD_SPLIT": 1}, {"HEAD_SPLIT": 4}]'
                                                   # the Llama-shaped training step's attention

Timings are medians of ``triton.testing.do_bench`` (backward alone: the graph kept, the forward
run once), the providers of a cell timed in turn, round after round, median of the rounds; TFLOPS
counted as in ``flashattn.measure.bench`` (backward 2.5x the forward's FLOPs).
"""
import argparse
import contextlib
import csv
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import flashattn  # noqa: E402
from flashattn import hopper  # noqa: E402
from flashattn.measure.bench import attention_flops, interleaved_ms  # noqa: E402
from flashattn.testing.reference import naive_attention  # noqa: E402
from flashattn.testing.rule import compare_with_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (batch, heads, K/V heads, N_q, N_kv, magnitude of q and k): odd lengths, one row, grouped heads
#: (groups of 8 and 16 too, whose walk the fused kernel splits: ``hopper.backward.head_split``),
#: N_q != N_kv, and large scores with few keys (keys past the end must add nothing to dQ: their
#: probabilities, 2**-LSE, overflow fp16 when the scores are large and negative).
SHAPES = [(2, 3, 3, 1, 1, 1), (2, 3, 3, 17, 17, 1), (1, 2, 2, 113, 113, 1), (2, 4, 4, 300, 300, 1),
          (1, 8, 2, 257, 257, 1), (1, 2, 2, 1000, 1000, 1), (1, 2, 2, 100, 300, 1), (1, 2, 2, 300, 100, 1),
          (1, 4, 1, 4097, 4097, 1), (2, 2, 2, 300, 1, 3), (1, 2, 2, 777, 70, 3),
          (1, 16, 2, 300, 300, 1), (1, 16, 1, 333, 333, 1)]


def attention(deterministic):
    """flashattn.attention on the fused (False) or the deterministic (True) backward."""
    return functools.partial(flashattn.attention, deterministic=deterministic)


def fused_calls():
    """Count the fused kernel's calls (so a check knows which path ran)."""
    gluon = hopper.load("backward")
    calls = [0]
    real = gluon.attention_backward

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    gluon.attention_backward = counted
    return calls


def backward(o, inputs, do):
    return torch.autograd.grad(o, inputs, do, retain_graph=True)


def checks(calls, dtypes, paths=(False, True), label=""):
    """Both backward paths (``paths``: deterministic or not) against float64 under the rule."""
    failures = 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for head_dim in (64, 128):
            for causal in (False, True):
                for b, h, h_kv, n_q, n_kv, magnitude in SHAPES:
                    g = torch.Generator(device="cuda").manual_seed(n_q * 7 + n_kv)
                    q = magnitude * torch.randn(b, h, n_q, head_dim, device="cuda", generator=g)
                    k = magnitude * torch.randn(b, h_kv, n_kv, head_dim, device="cuda", generator=g)
                    v = torch.randn(b, h_kv, n_kv, head_dim, device="cuda", generator=g)
                    q, k, v = (t.to(dtype) for t in (q, k, v))
                    ref = functools.partial(naive_attention, enable_gqa=h != h_kv)
                    for deterministic in paths:
                        before = calls[0]
                        impl = functools.partial(attention(deterministic), enable_gqa=h != h_kv)
                        result = compare_with_reference(q, k, v, is_causal=causal, impl=impl, reference=ref)
                        fused = calls[0] > before
                        bad = [c for c in result if not c.ok]
                        failures += bool(bad) or fused == deterministic
                        worst = max(c.error / c.bound for c in result)
                        print(f"{'FAIL' if bad or fused == deterministic else 'ok  '} {dtype_name} D{head_dim} "
                              f"{'causal' if causal else 'full  '} B{b} H{h}/{h_kv} {n_q}x{n_kv} x{magnitude} "
                              f"{'deterministic' if deterministic else 'fused'}: worst {worst:.2f} of the bound"
                              + (f" ({'; '.join(map(str, bad))})" if bad else "")
                              + ("" if fused != deterministic else " WRONG PATH") + label, flush=True)
    return failures


def determinism():
    """Two backward runs of each path on the same inputs: bit-identical or not."""
    q, k, v = (torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for deterministic in (False, True):
        o = flashattn.attention(q, k, v, is_causal=True, deterministic=deterministic)
        do = torch.randn_like(o)
        a = backward(o, (q, k, v), do)
        b = backward(o, (q, k, v), do)
        diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(a, b)]
        print(f"{'deterministic' if deterministic else 'fused'}: two runs differ by at most "
              f"dq {diffs[0]:.1e}, dk {diffs[1]:.1e}, dv {diffs[2]:.1e}", flush=True)


def timings(cells, out_csv, rounds=3, variants=()):
    """Each cell's TFLOPS: flashattn's forward, its fused and deterministic backward and SDPA's
    cuDNN backend, interleaved over ``rounds`` rounds; with ``variants`` (overrides of
    ``hopper.backward.dq_config``), the fused kernel called directly with its default (w0) and
    each of them (w1, ...). tools/forward_variants.py does the same for the forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gluon_fwd, gluon_bwd = hopper.load("forward"), hopper.load("backward")
    rows = []
    print(f"interleaved, {rounds} round(s), median; variants against the kernel's default (w0)", flush=True)
    print(f"{'dtype':5} {'D':>4} {'N':>6} {'causal':6} | {'fwd':>6} {'cudnn':>6} {'x':>5} | "
          f"{'fused':>6} {'determ':>6} {'cudnn':>6} {'fused x':>7} {'det x':>6}   (TFLOPS)", flush=True)
    for dtype_name, head_dim, n, causal, kv_heads, batch, heads in cells:
        dtype = DTYPES[dtype_name]
        kv_heads = kv_heads or heads
        gqa = dict(enable_gqa=True) if kv_heads != heads else {}
        q = torch.randn(batch, heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        do = torch.randn_like(q)
        tf = {m: attention_flops(batch, heads, n, n, head_dim, causal, m) * 1e-9 for m in ("fwd", "bwd")}
        # SDPA's cuDNN backend; where it refuses the call (grouped heads in some releases), SDPA's default
        peer = "cudnn"
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sdpa(q, k, v, is_causal=causal, **gqa)
        except RuntimeError:
            peer = "sdpa-default"

        def peer_backend():
            return sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if peer == "cudnn" else contextlib.nullcontext()

        def cudnn_fwd():
            with peer_backend():
                return sdpa(q, k, v, is_causal=causal, **gqa)
        with peer_backend():
            oc = sdpa(q, k, v, is_causal=causal, **gqa)
        outs = {det: flashattn.attention(q, k, v, is_causal=causal, deterministic=det, **gqa) for det in (False, True)}
        fns = {"fwd": lambda: flashattn.attention(q, k, v, is_causal=causal, **gqa),
               "cudnn_fwd": cudnn_fwd,
               "fused": lambda: backward(outs[False], (q, k, v), do),
               "determ": lambda: backward(outs[True], (q, k, v), do),
               "cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
        modes = dict(fwd="fwd", cudnn_fwd="fwd", fused="bwd", determ="bwd", cudnn="bwd")
        if variants:
            qd, kd, vd = (t.detach() for t in (q, k, v))
            scale = head_dim ** -0.5
            o, lse2 = gluon_fwd.attention_forward(qd, kd, vd, causal, scale)
            delta = (o.float() * do.float()).sum(-1)
            for i, cfg in enumerate([{}] + list(variants)):
                fns[f"w{i}"] = functools.partial(gluon_bwd.attention_backward, qd, kd, vd, do, lse2, delta,
                                                 causal, scale, cfg)
                modes[f"w{i}"] = "bwd"
        for fn in fns.values():
            fn()  # compile outside the timings
        res = {name: tf[modes[name]] / ms for name, ms in interleaved_ms(fns, rounds).items()}
        heads_note = f" B{batch} H{heads}" + (f"/{kv_heads} against {peer}" if gqa else "")
        extra = [f"{name} {res[name]:.0f} ({res[name] / res['w0']:.3f}x)"
                 for name in res if name[0] == "w" and name != "w0"]
        print(f"{dtype_name:5} {head_dim:4} {n:6} {int(causal):6} | {res['fwd']:6.0f} {res['cudnn_fwd']:6.0f} "
              f"{res['fwd'] / res['cudnn_fwd']:5.2f} | {res['fused']:6.0f} {res['determ']:6.0f} {res['cudnn']:6.0f} "
              f"{res['fused'] / res['cudnn']:7.2f} {res['determ'] / res['cudnn']:6.2f}{heads_note}"
              + ("   " + "  ".join(extra) if extra else ""), flush=True)
        rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                         dtype=dtype_name, head_dim=head_dim, seq_len=n, causal=int(causal), batch=batch,
                         heads=heads, kv_heads=kv_heads, peer=peer,
                         **{f"tflops_{k}": round(v, 1) for k, v in res.items()}))
        del q, k, v, do, outs, oc, fns
        torch.cuda.empty_cache()
    if out_csv and rows:
        fields = list(dict.fromkeys(f for r in rows for f in r))
        with open(out_csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--no-timings", action="store_true")
    p.add_argument("--csv")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (median)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--batch-heads", nargs="+", default=["4x32"], metavar="BxH",
                   help="batch x heads of the timed cells (several: each cell at each)")
    p.add_argument("--kv-heads", type=int, default=0, help="K/V heads of the timed cells (grouped heads; "
                   "default: as many as the query heads)")
    p.add_argument("--bwd-variants", type=json.loads, default=[],
                   help="JSON list of fused backward configurations (hopper.backward.dq_config's overrides)")
    p.add_argument("--check-variants", action="store_true",
                   help="check the fused backward with each of --bwd-variants too (bf16)")
    args = p.parse_args()
    print("GPU", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__,
          flush=True)
    gluon = hopper.load("backward")
    if gluon is None or not gluon.has_dq_reduce():
        sys.exit("the fused backward needs Gluon with TMA reduce-adds (Triton >= 3.8) on a Hopper GPU")
    calls = fused_calls()
    failures = 0 if args.no_checks else checks(calls, ["bf16"] if args.quick else args.dtypes)
    if args.check_variants:  # the fused path with each variant as its default, bf16
        for variant in args.bwd_variants:
            saved = {d: dict(c) for d, c in gluon.DQ_CONFIGS.items()}
            for cfg in gluon.DQ_CONFIGS.values():
                cfg.update(variant)
            failures += checks(calls, ["bf16"], paths=(False,), label=f" {json.dumps(variant)}")
            for d, c in saved.items():
                gluon.DQ_CONFIGS[d] = c
    determinism()
    shapes = [tuple(map(int, s.split("x"))) for s in args.batch_heads]
    cells = [(d, hd, n, bool(c), args.kv_heads, b, h) for d in args.dtypes for hd in args.head_dims
             for n in args.seq_lens for c in args.causal for b, h in shapes]
    if args.quick:
        cells = [c for c in cells if c[0] == "bf16" and c[2] == 8192]
    grouped = ("bf16", 128, 8192, True, 0, 4, 32)  # the sweep's grouped row: 32 query heads read 8 K/V heads
    if grouped in cells:  # a run that holds its ungrouped twin times it too
        cells.append(grouped[:4] + (8,) + grouped[5:])
    if not args.no_timings:
        timings(cells, args.csv, args.rounds, args.bwd_variants)
    print(f"{failures} check(s) failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
