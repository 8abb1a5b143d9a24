"""A profile of one attention forward and backward with Triton's profiler, proton, and how to read it.

proton records, for every GPU kernel launched while it runs, how often it ran and how long it took,
under the *scopes* the program opened around its launches (here one scope per pass, carrying the
FLOPs credited to that pass, so that the profile can say TFLOPS). It writes a tree in JSON
("hatchet" format): scopes with their kernels as children, each node with its metrics.

    python -m flashattn.measure.profiling --out figures/data/h200_proton_profile.json   # on a GPU

records one (after a warm-up that compiles and autotunes, so that only the timed passes are in it),
together with the GPU, the versions and the date. :func:`read` and :func:`kernel_rows` read such a
file on any machine, without proton.
"""
import argparse
import datetime
import glob
import json
import os
import tempfile

import torch

from .bench import attention_flops

#: The setting the chapters call the reference: bf16, causal, head dim 128, 128 heads x 8192 tokens.
REFERENCE = dict(dtype="bf16", batch=1, heads=128, n=8192, head_dim=128, causal=True)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def record(path, dtype="bf16", batch=1, heads=128, n=8192, head_dim=128, causal=True, repeats=10):
    """Profile ``repeats`` forward and backward passes of ``flashattn.attention`` on a GPU with proton
    and write the profile to ``path`` (JSON: the setting, the GPU, the versions, the date, and
    proton's tree under "proton"). Returns what :func:`read` returns."""
    if not torch.cuda.is_available():
        raise RuntimeError("record() needs a CUDA GPU: proton profiles GPU kernels")
    import triton
    import triton.profiler as proton

    from ..ops.attention import attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=DTYPES[dtype], generator=gen)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flops = {mode: attention_flops(batch, heads, n, n, head_dim, causal, mode) for mode in ("fwd", "bwd")}

    def step():
        with proton.scope("forward", {"flops": flops["fwd"]}):
            out = attention(q, k, v, is_causal=causal)
        with proton.scope("backward", {"flops": flops["bwd"]}):
            out.backward(do)

    step()  # compiles and autotunes outside the profile
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        proton.start(os.path.join(tmp, "profile"), context="shadow")
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
        proton.finalize()
        (written,) = glob.glob(os.path.join(tmp, "profile*"))
        with open(written) as f:
            tree = json.load(f)
    profile = dict(setting=dict(dtype=dtype, batch=batch, heads=heads, n=n, head_dim=head_dim, causal=causal,
                                repeats=repeats),
                   gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   date=datetime.date.today().isoformat(), proton=tree)
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
    return profile


def read(path):
    """A profile written by :func:`record`, as a dict (its "proton" entry is proton's own tree)."""
    with open(path) as f:
        return json.load(f)


def kernel_rows(profile):
    """One row per (scope, kernel) of a profile: ``dict(scope, kernel, count, ms, flops)``, where
    ``ms`` is the kernel's total time over all its launches and ``flops`` those credited to its
    scope (None outside a scope). proton's tree is a list: the root frame, then a dict of devices."""
    rows = []

    def walk(node, scope, scope_flops):
        name = node.get("frame", {}).get("name", "")
        metrics = node.get("metrics", {})
        if "flops" in metrics:
            scope, scope_flops = name, metrics["flops"]
        if "time (ns)" in metrics and metrics.get("count", 0) and not node.get("children"):
            rows.append(dict(scope=scope, kernel=name, count=int(metrics["count"]),
                             ms=metrics["time (ns)"] / 1e6, flops=scope_flops))
        for child in node.get("children", []):
            walk(child, scope, scope_flops)

    walk(profile["proton"][0], None, None)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--dtype", default=REFERENCE["dtype"], choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=REFERENCE["heads"])
    p.add_argument("--seq-len", type=int, default=REFERENCE["n"])
    p.add_argument("--head-dim", type=int, default=REFERENCE["head_dim"])
    p.add_argument("--causal", type=int, default=1, choices=(0, 1))
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    profile = record(args.out, args.dtype, 1, args.heads, args.seq_len, args.head_dim, bool(args.causal),
                     args.repeats)
    print(f"{profile['gpu']}, torch {profile['torch']}, triton {profile['triton']}, {profile['date']}: "
          f"{profile['setting']}")
    for row in kernel_rows(profile):
        per_call = row["ms"] / row["count"]
        print(f"  {row['scope'] or '-':9} {row['kernel'][:60]:60} x{row['count']:<4} {per_call:8.3f} ms per call")


if __name__ == "__main__":
    main()
