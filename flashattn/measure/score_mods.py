"""Benchmark the score modifications on a GPU, each next to what PyTorch offers for it, in bfloat16.

    python -m flashattn.measure.score_mods --out DIR/score_mods.csv          # on a GPU, about a minute
    python -m flashattn.measure.score_mods --quick --out DIR/score_mods.csv  # tiny, on the interpreter

One row per (modification, provider, mode), B = 2, H = 16, N = 4096, D = 128, causal unless said:

* ``causal``: the plain causal kernel, the baseline of every other row (``flashattn``, ``sdpa``);
* ``key-padding``: a boolean ``(B, 1, 1, N)`` mask hiding the last quarter of each sequence's keys,
  not causal (twice the causal baseline's pairs, a quarter of them hidden); SDPA gets the same mask;
* ``float-mask``: an additive ``(B, 1, N, N)`` float mask, read tile by tile (SDPA: the same mask);
* ``alibi``: ALiBi slopes per head; SDPA gets the bias as a float mask it has to read;
* ``softcap``: Gemma 2's cap of 50 on the scores; PyTorch has no such SDPA argument, so its row is
  FlexAttention's ``score_mod`` where it compiles here, else none;
* ``dropout``: ``dropout_p = 0.1`` in training mode (SDPA draws its own mask: the times compare,
  the values cannot);
* ``bottom-right``: causal aligned bottom-right with 1024 queries against 4096 keys (a chunk of a
  prompt after a cache), SDPA with ``causal_lower_right``.

Before timing, every flashattn output without dropout is compared with its PyTorch counterpart
(``max_diff``; a difference over ``variants.TOLERANCE`` stops the run). Modes ``fwd``, ``bwd`` and
``fwd+bwd`` are the medians of ``triton.testing.do_bench`` (the interpreter: one timed call).
"""
import argparse
import csv
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

import flashattn
from .variants import leaves, max_diff, timed_modes

FIELDS = ["gpu", "torch", "triton", "date", "modification", "provider", "mode", "ms", "ratio_to_causal",
          "max_diff"]
SIZES = {"gpu": dict(batch=2, heads=16, n=4096, head_dim=128, chunk=1024),
         "quick": dict(batch=1, heads=2, n=48, head_dim=16, chunk=16)}
SOFTCAP = 50.0


def alibi_slopes(heads, device):
    """ALiBi's slopes: a geometric sequence from 2**(-8 / heads) down to 2**-8."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)


def alibi_bias(slopes, n_q, n_k, device):
    """The additive bias ALiBi is, as a (H, n_q, n_k) float tensor, top-left aligned."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return -slopes[:, None, None] * (i - j).abs()


def _flex_softcap(q, k, v):
    """FlexAttention with a softcap score_mod, compiled; None where it is not available."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def score_mod(score, b, h, i, j):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def causal(b, h, i, j):
        return j <= i

    block_mask = create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def cases(s, device, dtype):
    """``{modification: (flashattn call, pytorch call or None, leaves, compare)}``."""
    batch, heads, n, d = s["batch"], s["heads"], s["n"], s["head_dim"]
    g = torch.Generator().manual_seed(0)
    q, k, v = leaves(*(torch.randn(batch, heads, n, d, generator=g).to(device, dtype) for _ in range(3)))
    kept = torch.arange(n, device=device) < (3 * n) // 4
    key_padding = kept.expand(batch, 1, 1, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    float_mask = torch.randn(batch, 1, n, n, generator=g).to(device, dtype).masked_fill(~causal, float("-inf"))
    slopes = alibi_slopes(heads, device)
    bias = (alibi_bias(slopes, n, n, device).to(dtype).masked_fill(~causal, float("-inf"))).expand(batch, -1, -1, -1)
    q_chunk = leaves(q[:, :, -s["chunk"]:].detach())[0]
    from torch.nn.attention.bias import causal_lower_right

    lower_right = causal_lower_right(s["chunk"], n)
    flex = _flex_softcap(q, k, v) if device.type == "cuda" else None
    return {
        "causal": (lambda: flashattn.attention(q, k, v, is_causal=True),
                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), True),
        "key-padding": (lambda: flashattn.attention(q, k, v, key_padding),
                        lambda: F.scaled_dot_product_attention(q, k, v, key_padding), (q, k, v), True),
        "float-mask": (lambda: flashattn.attention(q, k, v, float_mask),
                       lambda: F.scaled_dot_product_attention(q, k, v, float_mask), (q, k, v), True),
        "alibi": (lambda: flashattn.attention(q, k, v, is_causal=True, alibi_slopes=slopes),
                  lambda: F.scaled_dot_product_attention(q, k, v, bias), (q, k, v), True),
        "softcap": (lambda: flashattn.attention(q, k, v, is_causal=True, softcap=SOFTCAP), flex, (q, k, v),
                    flex is not None),
        "dropout": (lambda: flashattn.attention(q, k, v, dropout_p=0.1, is_causal=True),
                    lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True), (q, k, v),
                    False),
        "bottom-right": (lambda: flashattn.attention(q_chunk, k, v, is_causal=True, causal_alignment="bottom_right"),
                         lambda: F.scaled_dot_product_attention(q_chunk, k, v, lower_right), (q_chunk, k, v), True),
    }


def run(quick, out):
    s = SIZES["quick" if quick else "gpu"]
    device, dtype = flashattn.DEVICE, torch.bfloat16
    import triton

    meta = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat())
    rows, baseline = [], {}
    for name, (ours, theirs, inputs, compare) in cases(s, device, dtype).items():
        diff = ""
        if compare:
            with torch.no_grad():
                diff = f"{max_diff(ours(), theirs()):.3g}"
        for provider, fn in (("flashattn", ours), ("pytorch", theirs)):
            if fn is None:
                continue
            for mode, ms in timed_modes(fn, inputs, quick).items():
                if name == "causal":
                    baseline[(provider, mode)] = ms
                ratio = ms / baseline[(provider, mode)] if (provider, mode) in baseline else math.nan
                rows.append(dict(meta, modification=name, provider=provider, mode=mode, ms=f"{ms:.4g}",
                                 ratio_to_causal=f"{ratio:.3g}", max_diff=diff if provider == "flashattn" else ""))
                print(f"{name:>13} {provider:>10} {mode:>8} {ms:9.4g} ms  x{ratio:5.2f} of its causal   "
                      f"max_diff {diff or '-'}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the CSV to write")
    p.add_argument("--quick", action="store_true", help="tiny sizes (runs on the interpreter)")
    args = p.parse_args(argv)
    if not args.quick and flashattn.DEVICE.type != "cuda":
        sys.exit("score_mods times kernels on a CUDA GPU; on a CPU run it with --quick")
    run(args.quick, args.out)


if __name__ == "__main__":
    main()
