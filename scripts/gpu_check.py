"""Checks that need a GPU, on top of the test suite (which also runs there: see gpu_session.sh).

    python scripts/gpu_check.py configs [--part I/N]   every tile configuration the tuner may pick
    python scripts/gpu_check.py long                   8k and 16k tokens, autotuned, vs float64
    python scripts/gpu_check.py int64                  offsets past 2**31 elements
    python scripts/gpu_check.py determinism            bit-identical gradients on repeat
    python scripts/gpu_check.py sanitize               a small case to run under compute-sanitizer

Each case is judged by the rule of flashattn.testing (error against float64 within 2x, or 3x for
gradients, of PyTorch's own error in the same dtype, plus a floor) and printed as one line
starting with "ok" or "FAIL"; the exit status is non-zero if any case failed.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import flashattn  # noqa: E402
from flashattn import reference, tuning  # noqa: E402
from flashattn.backward import attention_backward  # noqa: E402
from flashattn.forward import attention_forward  # noqa: E402
from flashattn.testing import compare_with_reference, judge  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
failures = []


def report(label, checks):
    bad = [c for c in checks if not c.ok]
    worst = max(checks, key=lambda c: c.error / c.bound if c.bound else float("inf"))
    line = f"{'FAIL' if bad else 'ok  '} {label}: worst {worst.name} error {worst.error:.2e} <= bound {worst.bound:.2e}"
    if bad:
        line += " | " + "; ".join(map(str, bad))
        failures.append(label)
    print(line, flush=True)


def qkv(shape_q, shape_kv, dtype, seed=0, magnitude=1.0):
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(seed)
    q = torch.randn(shape_q, device=flashattn.DEVICE, generator=g) * magnitude
    k = torch.randn(shape_kv, device=flashattn.DEVICE, generator=g) * magnitude
    v = torch.randn(shape_kv, device=flashattn.DEVICE, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def kernel_level(q, k, v, causal, fwd_config=None, bwd_configs=None):
    """Run the launchers directly (explicit configs) and the references; judge all outputs."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5
    o, lse2 = attention_forward(q, k, v, causal, scale, config=fwd_config)
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(1)
    do = torch.randn(o.shape, device=flashattn.DEVICE, generator=g).to(dtype)
    dq, dk, dv = attention_backward(q, k, v, o, lse2, do, causal, scale, configs=bwd_configs)

    def ref(t_q, t_k, t_v):
        t = [x.detach().requires_grad_() for x in (t_q, t_k, t_v)]
        out, lse = reference.naive_attention(*t, is_causal=causal)
        grads = torch.autograd.grad(out, t, do.to(out.dtype))
        return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    ours = dict(out=o, lse=lse2 * 0.6931471805599453, dq=dq, dk=dk, dv=dv)
    return judge(ours, ref(q.double(), k.double(), v.double()), ref(q, k, v), dtype,
                 do.abs().max().item())


def check_configs(part):
    """Every candidate the tuner may pick, on a ragged causal case, for two head dims."""
    os.environ["FLASHATTN_AUTOTUNE"] = "0"  # the kernels not under test run their default tiles
    index, total = part
    cases = []
    for dtype, head_dim in (("bf16", 128), ("fp16", 64), ("bf16", 40)):
        block_d = tuning.block_d(head_dim)
        size = DTYPES[dtype].itemsize
        for name in ("fwd", "bwd_dkdv", "bwd_dq"):
            for c in tuning.GPU_CONFIGS[name]:
                if tuning.fits(name, c, block_d, size):
                    cases.append((dtype, head_dim, name, dict(c.kwargs, num_warps=c.num_warps,
                                                              num_stages=c.num_stages)))
    for i, (dtype, head_dim, name, config) in enumerate(cases):
        if i % total != index:
            continue
        for causal in (True, False):
            q, k, v = qkv((1, 3, 1000, head_dim), (1, 3, 1000, head_dim), DTYPES[dtype], seed=i)
            fwd = config if name == "fwd" else None
            bwd = {name: config} if name != "fwd" else None
            report(f"config {name} {config} {dtype} D={head_dim} causal={causal}",
                   kernel_level(q, k, v, causal, fwd, bwd))


def check_long():
    """Long sequences through the public API, autotuned, against float64."""
    for n, head_dim, dtype, causal in ((8192, 128, "bf16", True), (8192, 64, "fp16", False),
                                       (16384, 128, "bf16", True), (16384, 64, "fp16", False),
                                       (2048, 64, "fp32", True), (2048, 128, "fp32", False)):
        q, k, v = qkv((1, 2, n, head_dim), (1, 2, n, head_dim), DTYPES[dtype])
        t = time.time()
        checks = compare_with_reference(q, k, v, is_causal=causal)
        report(f"long N={n} D={head_dim} {dtype} causal={causal} ({time.time() - t:.0f}s with tuning)", checks)
        torch.cuda.empty_cache()


def check_int64():
    """B*H*N*D past 2**31 elements: the last heads start beyond any 32-bit offset."""
    heads, n, head_dim = 8200, 4096, 64
    assert heads * n * head_dim > 2**31
    q, k, v = qkv((1, heads, n, head_dim), (1, heads, n, head_dim), torch.float16)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = flashattn.attention(q, k, v, is_causal=True)
    g = torch.Generator(device=flashattn.DEVICE).manual_seed(2)
    do = torch.randn(out.shape, device=flashattn.DEVICE, generator=g).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    last = slice(heads - 2, heads)

    def ref(dtype):
        t = [x[:, last].detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse = reference.naive_attention(*t, is_causal=True)
        grads = torch.autograd.grad(o, t, do[:, last].to(dtype))
        return dict(out=o, dq=grads[0], dk=grads[1], dv=grads[2])

    ours = dict(out=out[:, last], dq=dq[:, last], dk=dk[:, last], dv=dv[:, last])
    report(f"int64 offsets: {heads} heads x {n} x {head_dim} = {heads * n * head_dim / 2**31:.2f} x 2**31 "
           f"elements, last two heads", judge(ours, ref(torch.float64), ref(torch.float16), torch.float16))


def check_determinism():
    for dtype, head_dim in (("bf16", 128), ("fp16", 64)):
        q, k, v = (t.requires_grad_() for t in qkv((2, 4, 3000, head_dim), (2, 4, 3000, head_dim), DTYPES[dtype]))
        do = torch.randn_like(q)
        first = torch.autograd.grad(flashattn.attention(q, k, v, is_causal=True), (q, k, v), do)
        same = all(torch.equal(a, b) for _ in range(3) for a, b in
                   zip(first, torch.autograd.grad(flashattn.attention(q, k, v, is_causal=True), (q, k, v), do)))
        print(f"{'ok  ' if same else 'FAIL'} determinism {dtype}: gradients bit-identical over 4 runs", flush=True)
        if not same:
            failures.append(f"determinism {dtype}")


def check_sanitize():
    """Small and ragged, fixed configurations (so that no autotuning runs under the sanitizer)."""
    os.environ["FLASHATTN_AUTOTUNE"] = "0"
    for causal in (True, False):
        q, k, v = qkv((1, 2, 77, 40), (1, 2, 45, 40), torch.float16)
        report(f"sanitize causal={causal}", kernel_level(q, k, v, causal))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="+", choices=["configs", "long", "int64", "determinism", "sanitize"])
    p.add_argument("--part", default="0/1", help="run only the I-th of N slices of the configs")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (interpreter)"
    print(f"# {gpu}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    for what in args.what:
        if what == "configs":
            check_configs(tuple(int(x) for x in args.part.split("/")))
        else:
            globals()[f"check_{what}"]()
    if failures:
        sys.exit(f"{len(failures)} FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
