"""Check and time configurations of the Gluon forward beside its default, on a Hopper GPU.

    python tools/forward_variants.py '[{"CONSUMERS": 2}, {"CONSUMERS": 2, "EXP2_FMA": 4}]'
    python tools/forward_variants.py '[{"EXP2_FMA": 2}]' --head-dims 128 --causal 1 --softcap 50
    python tools/forward_variants.py '[{"STAGES": 2}]' --head-dims 64 128 --csv OUT.csv

Each variant (v1, v2, ...: overrides of ``hopper.forward.tile_config``) is first checked against
float64 under the rule on a small odd shape (error / bound, for out and the LSE), then every cell
(B = 4, H = 32; bf16 and fp16, the head dims, N = 4k-16k, causal or not) times the default
configuration (v0), each variant and a peer in turn, round after round, median of the rounds:
the peer is SDPA's cuDNN backend, or with ``--softcap`` the plain call without the cap (v0's
configuration), while v0 and the variants cap the scores. Any Triton with Gluon: the forward
needs no TMA reduce-add.
"""
import argparse
import csv
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flashattn import hopper  # noqa: E402
from flashattn.kernels.tiles import LN2  # noqa: E402
from flashattn.measure.bench import attention_flops, interleaved_ms  # noqa: E402
from flashattn.testing.reference import naive_attention  # noqa: E402
from flashattn.testing.rule import compare_with_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check(gluon, cfg, dtype, head_dim, causal, softcap):
    """The worst error / bound of out and LSE, for one configuration, against float64."""
    g = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    # A cap of 3 bends unit scores (a cap of 30 or 50 would hardly touch them).
    cap = 3.0 if softcap else 0.0
    q, k, v = (torch.randn(2, 3, 1000, head_dim, device="cuda", generator=g).to(dtype) for _ in range(3))

    def impl(q, k, v, is_causal, scale, return_lse):
        o, lse2 = gluon.attention_forward(q, k, v, is_causal, scale or head_dim ** -0.5, cfg, softcap=cap)
        return o, lse2 * LN2

    result = compare_with_reference(q, k, v, is_causal=causal, backward=False, impl=impl,
                                    reference=functools.partial(naive_attention, softcap=cap))
    return max(c.error / c.bound for c in result), all(c.ok for c in result)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", type=json.loads, help="JSON list of configurations")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--softcap", type=float, default=0.0, help="time v0 and the variants with this cap")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--csv")
    args = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gluon = hopper.load("forward")
    if gluon is None or not torch.cuda.is_available():
        sys.exit("the Gluon forward needs a Hopper GPU and a Triton with Gluon")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    configs = [{}] + args.variants
    peer = "plain" if args.softcap else "cudnn"
    print(f"{meta}; v0 = the default; peer: {peer}; softcap {args.softcap}; interleaved, {args.rounds} "
          "rounds, median", flush=True)
    failures = 0
    for i, cfg in enumerate(configs):
        for d in args.head_dims:
            for causal in args.causal:
                for dtype_name in args.dtypes:
                    worst, ok = check(gluon, cfg, DTYPES[dtype_name], d, bool(causal), args.softcap)
                    failures += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} v{i} {cfg} D{d} {dtype_name} causal={causal}: "
                          f"worst {worst:.2f} of the bound", flush=True)
    rows = []
    for d in args.head_dims:
        for dtype_name in args.dtypes:
            for n in args.seq_lens:
                for causal in map(bool, args.causal):
                    b, h, scale = 4, 32, d ** -0.5
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPES[dtype_name]) for _ in range(3))

                    def cudnn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return sdpa(q, k, v, is_causal=causal)
                    fns = {peer: functools.partial(gluon.attention_forward, q, k, v, causal, scale) if args.softcap
                           else cudnn}
                    for i, cfg in enumerate(configs):
                        fns[f"v{i}"] = functools.partial(gluon.attention_forward, q, k, v, causal, scale, cfg,
                                                         softcap=args.softcap)
                    for fn in fns.values():
                        fn()  # compile outside the timings
                    flops = attention_flops(b, h, n, n, d, causal, "fwd") * 1e-9
                    tf = {name: flops / ms for name, ms in interleaved_ms(fns, args.rounds).items()}
                    print(f"D{d} {dtype_name} N{n:<5} causal={int(causal)} {peer} {tf[peer]:5.0f} | "
                          + "  ".join(f"v{i} {tf[f'v{i}']:5.0f} ({tf[f'v{i}'] / tf[peer]:.3f}x {peer}"
                                      + (f", {tf[f'v{i}'] / tf['v0']:.3f}x v0)" if i else ")")
                                      for i in range(len(configs))), flush=True)
                    rows += [dict(meta, dtype=dtype_name, head_dim=d, seq_len=n, causal=int(causal), batch=b,
                                  heads=h, softcap=args.softcap, provider=name,
                                  config=json.dumps(configs[int(name[1:])]) if name[0] == "v" else "",
                                  tflops=round(value, 1)) for name, value in tf.items()]
                    del q, k, v, fns
                    torch.cuda.empty_cache()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"{failures} check(s) failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
