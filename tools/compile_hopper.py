"""Compile the Gluon kernels for Hopper (sm_90) without a GPU, and report what the compiler made.

    python tools/compile_hopper.py [--kernel fwd|bwd|bwd_dq] [--head-dim 64] [--dtype bf16] [--causal 1]
                                   [--config '{"STAGES": 3}'] [--variants] [--mods alibi,softcap]

Gluon has no interpreter, so compiling is the only check these kernels get on a machine without
a GPU: it catches errors in layouts, shared memory and barriers that only the compiler sees, and
prints what each configuration costs: registers per thread at launch (each partition then sets its
own budget with setmaxnreg, listed last), spilled bytes, shared memory, and the wgmma
instructions, TMA copies and mbarrier waits in the PTX, and the codes of ptxas's notes (C7517: a
wgmma wait it had to inject), and how many SASS instructions the kernel holds (a rough guide to a
change's cost: the plain kernel's count over a modified one's came within 0.03 of dropout's
measured share of the plain call's speed, not of every modification's: docs/performance.md).
``--variants`` adds the forward variants that tools/hopper_check.py times
(flashattn.measure.gpu_checks.VARIANTS); ``--mods`` compiles every kernel with these score
modifications (of softcap, alibi, window, dropout; with a window, the masked configuration only;
key_mask, a key-padding mask, the backward kernels only).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flashattn.measure import compiled, compiled_gluon, gpu_checks  # noqa: E402  (the checkout's flashattn)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=["fwd", "bwd", "bwd_dq"], action="append")
    p.add_argument("--head-dim", type=int, action="append")
    p.add_argument("--dtype", choices=["fp16", "bf16"], action="append")
    p.add_argument("--causal", type=int, choices=(0, 1), action="append")
    p.add_argument("--config", type=json.loads, action="append", help="overrides, as JSON")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--mods", default="", help="comma-separated score modifications, e.g. alibi,softcap")
    args = p.parse_args()
    mods = [m for m in args.mods.split(",") if m]
    unknown = set(mods) - set(compiled_gluon.BACKWARD_MODS)
    if unknown:
        p.error(f"--mods: unknown {sorted(unknown)}; expected some of {', '.join(compiled_gluon.BACKWARD_MODS)}")
    backward_only = "key_mask" in mods  # the forward reads no key mask
    if backward_only and "fwd" in (args.kernel or []):
        p.error("--mods key_mask: the backward kernels only (--kernel bwd or bwd_dq)")
    causal = [bool(c) for c in (args.causal or [0, 1])] if "window" not in mods else [True]
    failures = 0
    print(f"{'kernel':6} {'D':>4} {'dtype':5} {'causal':6} {'config':40} {'regs':>4} {'spill':>5} "
          f"{'smem':>6} {'wgmma':>5} {'tma':>5} {'waits':>5} {'sass':>5} setmaxnreg ptxas")
    for kernel in args.kernel or (["bwd", "bwd_dq"] if backward_only else ["fwd", "bwd", "bwd_dq"]):
        for head_dim in args.head_dim or [64, 128]:
            configs = list(args.config or [None])
            if args.variants and kernel == "fwd":
                configs += gpu_checks.VARIANTS[head_dim]
            try:
                rows = compiled.in_child("flashattn.measure.compiled_gluon:gluon_report", kernel=kernel,
                                         head_dims=[head_dim], dtypes=args.dtype or ["fp16", "bf16"],
                                         causal=causal, configs=configs,
                                         mods=mods, instructions=True)
            except compiled.CannotCompile as reason:
                print(f"cannot compile here: {reason}")
                sys.exit(1)
            for r in rows:
                label = json.dumps(r["config"]) if r["config"] else "default"
                head = f"{kernel:6} {head_dim:4} {r['dtype']:5} {int(r['causal']):6} {label:40}"
                if "error" in r:
                    failures += 1
                    print(f"{head} FAILED: {r['error'][:300]}", flush=True)
                    continue
                notes = " ".join(sorted({code for code, _ in r["ptxas_notes"]}))
                print(f"{head} {r['regs']:4} {r['spill']:5} {r['smem'] // 1024:5}K {r['wgmma']:5} "
                      f"{r['tma_loads']}+{r['tma_stores']:<3} {r['mbarrier_waits']:5} {r['instructions']:5} "
                      f"{r['setmaxnreg']} {notes}",
                      flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
