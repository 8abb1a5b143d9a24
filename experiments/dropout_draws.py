"""Cheaper dropout draws than the package's, compiled for sm_90 on any machine and, on an H100 or
H200, checked and timed. None is adopted: docs/performance.md ("Cheaper draws, compiled only")
says what was found.

    python experiments/dropout_draws.py                    # SASS instructions of each draw, any machine
    python experiments/dropout_draws.py --check            # each draw's kernels agree (CPU: interpreter)
    python experiments/dropout_draws.py --time --out-dir D # on a Hopper GPU: checked and timed

The package draws 16 bits a pair from a 10-round Philox call (``tiles.dropout_keep``: 8 pairs a
call, p within 2**-17 of ``dropout_p``). The draws tried here keep its layout of pairs in calls:

* ``rounds7``: 7 rounds, as FlashAttention-2 and PyTorch's copy of it draw (Philox-4x32-7 passes
  the BigCrush tests; 10 is the margin its authors recommend), 16 bits a pair;
* ``bits8``: 7 rounds and 8 bits a pair, 16 pairs a call, p rounded to a multiple of 1/256, as
  FlashAttention-2 compares bytes with ``p_dropout_in_uint8_t``.

Without ``--time`` each draw's Gluon forward and fused backward (bf16, head dim 128, causal and
not) are compiled in a child process and their SASS instructions counted beside the kernels
without dropout: plain / with-dropout is what the draw would keep of the plain call's speed if
the kernels were bound by issuing instructions. For the package's draw that estimate was within
0.03 of the share measured on an H100 (docs/performance.md). ``--check`` runs, with each draw, two
calls forward and backward against float64 given the mask the call returned (the forward, the
backward and the mask kernel must draw the same pairs), and the share of pairs dropped at
p = 0.1. With ``--time`` a child per draw runs ``gpu_checks``' dropout cases against float64 (the
reference takes the mask the call drew, with that draw) and ``score_mods``' dropout rows beside
the same calls without dropout, writing ``D/draw-<name>.csv``.
"""
import argparse
import json
import os
import subprocess
import sys

if "--compile-child" in sys.argv:  # flashattn then defines its kernels for the compiler, GPU or not
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "sm_90, compile only"
import flashattn  # noqa: E402,F401  (before the draws: on a CPU it turns Triton's interpreter on)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROUNDS: tl.constexpr = tl.constexpr(7)


@triton.jit
def keep_with(seed, p_drop, rows, cols, col0, BLOCK_KV: tl.constexpr, DROPOUT: tl.constexpr, BITS: tl.constexpr):
    """``tiles.dropout_keep`` with ``ROUNDS`` Philox rounds and ``BITS`` (16 or 8) a pair. A call
    serves the ``128 / BITS`` columns a thread holds in a span of ``512 / BITS`` (the tensor core's
    pairs of neighbours, 8 apart): column c takes slot ``2 * (c >> 3 & (SPAN / 8 - 1)) + (c & 1)``,
    part ``slot % (32 / BITS)`` of word ``slot // (32 / BITS)``. With 16 bits, the package's pairs."""
    SPAN: tl.constexpr = 512 // BITS
    PARTS: tl.constexpr = 32 // BITS
    if DROPOUT == 1 and BLOCK_KV % SPAN == 0:
        c = cols
    else:
        c = col0 % SPAN + cols
    group = (col0 // SPAN + c // SPAN) * 4 + ((c >> 1) & 3)
    rows = rows.to(tl.int64)
    r0, r1, r2, r3 = tl.philox(seed, group.to(tl.uint32), rows.to(tl.uint32), (rows >> 32).to(tl.uint32),
                               group.to(tl.uint32) * 0, ROUNDS)
    slot = ((c >> 3) & (SPAN // 8 - 1)) * 2 + (c & 1)
    word = slot // PARTS
    bits = tl.where(word < 2, tl.where(word == 0, r0, r1), tl.where(word == 2, r2, r3))
    bits = (bits >> ((slot % PARTS) * BITS).to(tl.uint32)) & ((1 << BITS) - 1)
    return bits.to(tl.int32) >= tl.cast(p_drop * (1 << BITS) + 0.5, tl.int32)


@triton.jit
def keep_rounds7(seed, p_drop, rows, cols, col0, BLOCK_KV: tl.constexpr, DROPOUT: tl.constexpr):
    """7 rounds, 16 bits a pair: the package's pairs and bits from fewer rounds."""
    return keep_with(seed, p_drop, rows, cols, col0, BLOCK_KV, DROPOUT, 16)


@triton.jit
def keep_bits8(seed, p_drop, rows, cols, col0, BLOCK_KV: tl.constexpr, DROPOUT: tl.constexpr):
    """7 rounds, 8 bits a pair: 16 pairs a call, FlashAttention-2's draw."""
    return keep_with(seed, p_drop, rows, cols, col0, BLOCK_KV, DROPOUT, 8)


DRAWS = {"package": None, "rounds7": keep_rounds7, "bits8": keep_bits8}
#: The modules that import ``tiles.dropout_keep`` by name: a draw replaces it in each, before any
#: kernel compiles (a child process per draw, as Triton keys its cache on a kernel's first compile).
USERS = ("flashattn.kernels.forward", "flashattn.kernels.backward", "flashattn.kernels.mods",
         "flashattn.hopper.forward", "flashattn.hopper.backward")


def use(draw):
    import importlib

    if DRAWS[draw] is None:
        return
    for name in USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # no Gluon in this Triton: the Triton kernels alone
            continue
        module.dropout_keep = DRAWS[draw]


def compile_child(draw):
    """Print, as JSON, the SASS instruction count and spilled bytes of the Gluon forward and fused
    backward with ``draw`` and without dropout (bf16, head dim 128, causal and not)."""
    use(draw)
    from flashattn.measure import compiled_gluon as cg
    from flashattn.measure.compiled import resources, sass_instructions

    rows = []
    for kind in ("forward", "backward"):
        for causal in (True, False):
            for mods in ((), ("dropout",)):
                if kind == "forward":
                    kernel = cg.compile_hopper_forward(128, "bf16", causal, mods=mods)
                else:
                    kernel = cg.compile_hopper_backward(128, "bf16", causal, dq=True, mods=mods)
                rows.append(dict(kernel=kind, causal=causal, dropout=bool(mods), sass=sass_instructions(kernel),
                                 spill=resources(kernel)[1]))
    print("RESULT " + json.dumps(rows))


def check_child(draw):
    """With ``draw``: two calls (causal, and not with more keys than queries) against float64
    given the mask each returned, forward and backward, under the rule; then the share dropped."""
    import functools

    import torch
    from flashattn import DEVICE, attention
    from flashattn.testing.reference import naive_attention
    from flashattn.testing.rule import compare_with_reference

    use(draw)
    g = torch.Generator().manual_seed(0)
    failed = False
    for causal, n_q, n_kv in ((True, 37, 37), (False, 20, 70)):
        q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(DEVICE) for n in (n_q, n_kv, n_kv))
        torch.manual_seed(5)
        keep = attention(q, k, v, is_causal=causal, dropout_p=0.3, return_dropout_mask=True)[1]
        torch.manual_seed(5)  # compare_with_reference's call draws the same mask again
        checks = compare_with_reference(q, k, v, is_causal=causal, impl=functools.partial(attention, dropout_p=0.3),
                                        reference=functools.partial(naive_attention, dropout_p=0.3,
                                                                    dropout_keep=keep))
        failed |= not all(c.ok for c in checks)
        print(f"{draw:>8} {'causal' if causal else 'dense':>6} {n_q}x{n_kv}: "
              + ("ok" if all(c.ok for c in checks) else "; ".join(str(c) for c in checks if not c.ok)))
    zeros = [torch.zeros(1, 4, n, 64, device=DEVICE) for n in (64, 256, 256)]
    keep = attention(*zeros, dropout_p=0.1, return_dropout_mask=True)[1]
    print(f"{draw:>8} dropped {1 - keep.float().mean().item():.4f} of {keep.numel()} pairs at p = 0.1")
    sys.exit(1 if failed else 0)


def time_child(draw, out_dir):
    """On a Hopper GPU, with ``draw``: gpu_checks' dropout cases against float64, then
    score_mods' dropout rows (and their plain baselines) into ``out_dir/draw-<draw>.csv``."""
    use(draw)
    from flashattn.measure import gpu_checks, score_mods

    for head_dim in (64, 128):
        gpu_checks.child_gluon_mods(argparse.Namespace(tanh_approx=None, deterministic=0, dtype="bf16",
                                                       head_dim=head_dim, skip=[], only=["dropout"]))
    score_mods.run(False, os.path.join(out_dir, f"draw-{draw}.csv"), ["dropout", "dropout-dense"])


def child(*args, timeout, capture=False):
    """Run this script with ``args`` in a fresh process (a draw patched before any kernel compiles),
    under ``timeout`` seconds (a kernel waiting on a barrier would wait forever); its output shown
    as it comes, or with ``capture`` returned. This process's ``import flashattn`` turned Triton's
    interpreter on where there is no GPU: the child decides that for itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        result = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, timeout=timeout,
                                capture_output=capture, text=True)
    except subprocess.TimeoutExpired:
        sys.exit(f"{' '.join(args)}: stopped after {timeout} s")
    if result.returncode:
        sys.exit(f"{' '.join(args)} failed" + (f":\n{result.stdout[-3000:]}{result.stderr[-3000:]}" if capture else ""))
    return result.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="check each draw's kernels against float64")
    mode.add_argument("--time", action="store_true", help="check and time each draw (a Hopper GPU)")
    p.add_argument("--out-dir", default=".", help="where --time writes draw-<name>.csv")
    p.add_argument("--draws", default=",".join(DRAWS), help=f"comma-separated, of {list(DRAWS)}")
    p.add_argument("--compile-child", help=argparse.SUPPRESS)
    p.add_argument("--check-child", help=argparse.SUPPRESS)
    p.add_argument("--time-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compile_child:
        return compile_child(args.compile_child)
    if args.check_child:
        return check_child(args.check_child)
    if args.time_child:
        return time_child(args.time_child, args.out_dir)
    draws = args.draws.split(",")
    if set(draws) - set(DRAWS):
        p.error(f"--draws: unknown {sorted(set(draws) - set(DRAWS))}; expected some of {list(DRAWS)}")
    for draw in draws:
        if args.check:
            child("--check-child", draw, timeout=900)
            continue
        if args.time:
            print(f"== {draw}", flush=True)
            child("--time-child", draw, "--out-dir", args.out_dir, timeout=600)
            continue
        out = child("--compile-child", draw, timeout=1200, capture=True)
        rows = json.loads(out.split("RESULT ", 1)[1])
        plain = {(r["kernel"], r["causal"]): r["sass"] for r in rows if not r["dropout"]}
        for r in rows:
            if r["dropout"]:
                share = plain[r["kernel"], r["causal"]] / r["sass"]
                print(f"{draw:>8} {r['kernel']:>8} {'causal' if r['causal'] else 'dense':>6}: {r['sass']:5d} SASS "
                      f"instructions against {plain[r['kernel'], r['causal']]} without dropout "
                      f"(plain/dropout {share:.2f}), {r['spill']} bytes spilled", flush=True)


if __name__ == "__main__":
    main()
