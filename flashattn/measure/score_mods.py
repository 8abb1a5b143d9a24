"""Benchmark the score modifications on a GPU, each next to what PyTorch offers for it, in bfloat16.

    python -m flashattn.measure.score_mods --out DIR/score_mods.csv          # on a GPU, a few minutes
    python -m flashattn.measure.score_mods --quick --out DIR/score_mods.csv  # tiny, on the interpreter

One row per (modification, provider, mode), B = 4, H = 32, N = 8192, D = 128, causal unless said:

* ``dense`` and ``causal``: the plain kernels, the baselines of the rows below (``flashattn``,
  ``sdpa``); ``ratio_to_baseline`` is a row's time over its provider's baseline;
* ``key-padding``: a boolean ``(B, 1, 1, N)`` mask keeping the first N, 3N/4, N/2 and N/4 keys of
  the four sequences, not causal (baseline ``dense``: 5/8 of its pairs are kept); SDPA gets the
  same mask, FlexAttention (``flex``, compiled) a block mask made from the lengths;
* ``float-mask``: an additive ``(B, 1, N, N)`` float mask, -inf above the diagonal;
* ``documents``: a boolean ``(B, 1, N, N)`` mask of documents packed in each row (lengths N/2, N/4,
  N/8, N/8, rotated from one sequence to the next), causal within each (0.34 of the causal pairs);
  SDPA gets the same mask, FlexAttention a block mask of the same ``mask_mod``;
* ``alibi``: ALiBi slopes per head; SDPA gets the bias as a float mask it has to read, FlexAttention
  a ``score_mod`` with the causal block mask;
* ``softcap``: Gemma 2's cap of 50 on the scores; FlexAttention's ``score_mod`` (no SDPA row);
* ``window``: causal with a sliding window of N/8 keys, against FlexAttention's block mask and
  SDPA with the window as a boolean mask; ``window-32k``: a window of 4096 keys at N = 32768,
  B = 1, against FlexAttention (baseline ``causal-32k``, the same call without the window);
* on a GPU, ``alibi``, ``softcap``, ``window`` and ``dropout`` also time
  ``flashattn-deterministic`` (``deterministic=True``: the backward without dQ's reduce-adds, for
  the same call), ``softcap`` ``flashattn-tanh-exact`` (the Gluon kernels' exact tanh in place of
  the special-function unit's, ``hopper.forward.TANH_APPROX`` off), ``dropout`` ``flashattn-triton``
  (the Triton kernels alone, ``FLASHATTN_GLUON=0``) and ``key-padding`` ``flashattn-triton-key-mask``
  (the backward on the Triton kernels with tile lists, ``hopper.FUSED_KEY_MASKS`` off; by default
  the fused Gluon backward reads the mask);
* ``dropout``: ``dropout_p = 0.1`` in training mode, against SDPA's FlashAttention-2 backend
  (``sdpa-flash``; each draws its own mask: the times compare, the values cannot);
  ``dropout-dense`` the same without the causal mask;
* ``bottom-right``: causal aligned bottom-right with N/4 queries against N keys (a chunk of a
  prompt after a cache), SDPA with ``causal_lower_right``.

Before timing, every flashattn output without dropout is compared with its peers' (``max_diff``;
a difference over ``variants.TOLERANCE`` stops the run). Modes ``fwd``, ``bwd`` and ``fwd+bwd``
are the medians of ``triton.testing.do_bench`` (the interpreter: one timed call);
``flashattn_speedup`` is a peer's time over flashattn's for the same modification and mode. A
peer that fails (FlexAttention cannot compile here, say) is reported and left out.
"""
import argparse
import contextlib
import csv
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

import flashattn
from .variants import leaves, max_diff, timed_modes

FIELDS = ["gpu", "torch", "triton", "date", "modification", "provider", "mode", "ms", "baseline",
          "ratio_to_baseline", "flashattn_speedup", "max_diff"]
SIZES = {"gpu": dict(batch=4, heads=32, n=8192, head_dim=128, chunk=2048, long_n=32768, long_window=4096),
         "quick": dict(batch=4, heads=1, n=32, head_dim=16, chunk=16, long_n=64, long_window=16)}
SOFTCAP = 50.0
DROPOUT = 0.1


def alibi_slopes(heads, device):
    """ALiBi's slopes: a geometric sequence from 2**(-8 / heads) down to 2**-8."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)


def alibi_bias(slopes, n_q, n_k, device, dtype=torch.float32):
    """The additive bias ALiBi is, as a (H, n_q, n_k) tensor of ``dtype``, top-left aligned (built
    in that dtype: at H = 32 and N = 8192 a float32 copy alone would take 8.6 GB)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return -slopes.to(dtype)[:, None, None] * (i - j).abs().to(dtype)


def padding_lengths(batch, n):
    """The kept keys of each sequence: N, 3N/4, N/2, N/4, and again for a larger batch."""
    return [n * (4 - b % 4) // 4 for b in range(batch)]


def key_padding_mask(lengths, n, device):
    """The boolean ``(B, 1, 1, N)`` mask keeping the first ``lengths[b]`` keys of sequence ``b``."""
    kept = torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return kept.reshape(len(lengths), 1, 1, n)


def key_padding_mod(lengths):
    """FlexAttention's ``mask_mod`` of :func:`key_padding_mask`: ``lengths`` a tensor on the device."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]
    return mask_mod


def document_ids(batch, n, device):
    """Which document each token belongs to, ``(B, N)``: four documents of N/2, N/4, N/8 and N/8
    tokens, the list rotated by one for each next sequence."""
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    rows = []
    for b in range(batch):
        order = sizes[b % 4:] + sizes[:b % 4]
        rows.append(torch.repeat_interleave(torch.arange(4), torch.tensor(order)))
    return torch.stack(rows).to(device)


def document_mask(ids):
    """The boolean ``(B, 1, N, N)`` mask of :func:`document_ids`: a query sees the keys of its own
    document up to itself."""
    n = ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def document_mod(ids):
    """FlexAttention's ``mask_mod`` of :func:`document_mask`."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)
    return mask_mod


def window_mod(left):
    """FlexAttention's mask_mod of a causal window of ``left`` keys back."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)
    return mask_mod


def causal_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _flex(q, k, v, mask_mod, batch=None, score_mod=None):
    """FlexAttention with the block mask of ``mask_mod`` (per sequence where ``batch`` is given)
    and ``score_mod``, compiled; None where it is not available."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    block_mask = create_block_mask(mask_mod, batch, None, q.shape[-2], k.shape[-2], device=q.device)
    # The backward is timed alone with retain_graph=True, which a compiled backward that donates
    # its saved buffers refuses (it did for the window's block mask on an H100, torch 2.11).
    import torch._dynamo.config
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False
    # Every case compiles the same function (its block mask and score_mod are new guards each
    # time): past dynamo's default limit of 8 compilations it ran flex_attention uncompiled, which
    # materialises the scores and ran out of memory at 32k (an H100, torch 2.11).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _sdpa_flash(q, k, v, **kwargs):
    """SDPA on its FlashAttention-2 backend alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return call


@contextlib.contextmanager
def provider_setting(provider):
    """What a flashattn provider other than the default sets while it runs and is timed (forward
    and backward): ``flashattn-triton`` the Triton kernels alone, ``flashattn-tanh-exact`` the
    Gluon kernels' exact tanh, ``flashattn-triton-key-mask`` a key-padding mask's backward on the
    Triton kernels (``hopper.FUSED_KEY_MASKS`` off)."""
    if provider == "flashattn-triton":
        before = os.environ.get("FLASHATTN_GLUON")
        os.environ["FLASHATTN_GLUON"] = "0"
        try:
            yield
        finally:
            os.environ.pop("FLASHATTN_GLUON") if before is None else os.environ.update(FLASHATTN_GLUON=before)
        return
    if provider == "flashattn-tanh-exact":
        from ..hopper import forward as module
        name, value = "TANH_APPROX", False
    elif provider == "flashattn-triton-key-mask":
        from .. import hopper as module
        name, value = "FUSED_KEY_MASKS", False
    else:
        yield
        return
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def cases(s, device, dtype):
    """``{modification: (baseline, leaves, flashattn call, {peer: call}, compare)}``: the peers'
    outputs are compared with flashattn's where ``compare``."""
    batch, heads, n, d = s["batch"], s["heads"], s["n"], s["head_dim"]
    g = torch.Generator().manual_seed(0)
    q, k, v = leaves(*(torch.randn(batch, heads, n, d, generator=g).to(device, dtype) for _ in range(3)))
    on_gpu = device.type == "cuda"
    lengths = padding_lengths(batch, n)
    key_padding = key_padding_mask(lengths, n, device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    float_mask = torch.randn(batch, 1, n, n, generator=g).to(device, dtype).masked_fill(~causal, float("-inf"))
    documents = document_ids(batch, n, device)
    in_document = document_mask(documents)
    slopes = alibi_slopes(heads, device)
    bias = alibi_bias(slopes, n, n, device, dtype).masked_fill_(~causal, float("-inf")).expand(batch, -1, -1, -1)
    q_chunk = leaves(q[:, :, -s["chunk"]:].detach())[0]
    long = leaves(*(torch.randn(1, heads, s["long_n"], d, generator=g).to(device, dtype) for _ in range(3)))
    from torch.nn.attention.bias import causal_lower_right

    lower_right = causal_lower_right(s["chunk"], n)
    qkv = (q, k, v)
    left = n // 8
    positions = torch.arange(n, device=device)
    in_window = causal & (positions[:, None] - positions[None, :] <= left)

    def sdpa(*args, **kwargs):
        return lambda: F.scaled_dot_product_attention(*args, **kwargs)

    def flex(*args, **kwargs):
        return {"flex": _flex(*args, **kwargs)} if on_gpu else {}

    def softcap_mod(score, b, h, i, j):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi_mod(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    fa = flashattn.attention

    def deterministic(**kwargs):  # the same call's backward without dQ's reduce-adds (GPU only)
        return {"flashattn-deterministic": lambda: fa(q, k, v, deterministic=True, **kwargs)} if on_gpu else {}

    def setting(provider, **kwargs):  # the same call under provider_setting (GPU only)
        return {provider: lambda: fa(q, k, v, **kwargs)} if on_gpu else {}
    return {
        "dense": ("dense", qkv, lambda: fa(q, k, v), {"sdpa": sdpa(q, k, v)}, True),
        "causal": ("causal", qkv, lambda: fa(q, k, v, is_causal=True), {"sdpa": sdpa(q, k, v, is_causal=True)}, True),
        "key-padding": ("dense", qkv, lambda: fa(q, k, v, key_padding),
                        {"sdpa": sdpa(q, k, v, key_padding),
                         **flex(q, k, v, key_padding_mod(torch.tensor(lengths, device=device)), batch),
                         **setting("flashattn-triton-key-mask", attn_mask=key_padding)}, True),
        "float-mask": ("causal", qkv, lambda: fa(q, k, v, float_mask), {"sdpa": sdpa(q, k, v, float_mask)}, True),
        "documents": ("causal", qkv, lambda: fa(q, k, v, in_document),
                      {"sdpa": sdpa(q, k, v, in_document), **flex(q, k, v, document_mod(documents), batch)}, True),
        "alibi": ("causal", qkv, lambda: fa(q, k, v, is_causal=True, alibi_slopes=slopes),
                  {"sdpa": sdpa(q, k, v, bias), **flex(q, k, v, causal_mod, score_mod=alibi_mod),
                   **deterministic(is_causal=True, alibi_slopes=slopes)}, True),
        "softcap": ("causal", qkv, lambda: fa(q, k, v, is_causal=True, softcap=SOFTCAP),
                    {**flex(q, k, v, causal_mod, score_mod=softcap_mod),
                     **deterministic(is_causal=True, softcap=SOFTCAP),
                     **setting("flashattn-tanh-exact", is_causal=True, softcap=SOFTCAP)}, True),
        "window": ("causal", qkv, lambda: fa(q, k, v, is_causal=True, window_size=(left, -1)),
                   {"sdpa": sdpa(q, k, v, in_window), **flex(q, k, v, window_mod(left)),
                    **deterministic(is_causal=True, window_size=(left, -1))}, True),
        "causal-32k": ("causal-32k", long, lambda: fa(*long, is_causal=True), flex(*long, causal_mod), True),
        "window-32k": ("causal-32k", long, lambda: fa(*long, is_causal=True, window_size=(s["long_window"], -1)),
                       flex(*long, window_mod(s["long_window"])), True),
        "dropout": ("causal", qkv, lambda: fa(q, k, v, dropout_p=DROPOUT, is_causal=True),
                    {"sdpa-flash": _sdpa_flash(q, k, v, dropout_p=DROPOUT, is_causal=True),
                     **deterministic(dropout_p=DROPOUT, is_causal=True),
                     **setting("flashattn-triton", dropout_p=DROPOUT, is_causal=True)} if on_gpu else
                    {"sdpa": sdpa(q, k, v, dropout_p=DROPOUT, is_causal=True)}, False),
        "dropout-dense": ("dense", qkv, lambda: fa(q, k, v, dropout_p=DROPOUT),
                          {"sdpa-flash": _sdpa_flash(q, k, v, dropout_p=DROPOUT),
                           **setting("flashattn-triton", dropout_p=DROPOUT)} if on_gpu else
                          {"sdpa": sdpa(q, k, v, dropout_p=DROPOUT)}, False),
        "bottom-right": ("causal", (q_chunk, k, v),
                         lambda: fa(q_chunk, k, v, is_causal=True, causal_alignment="bottom_right"),
                         {"sdpa": sdpa(q_chunk, k, v, lower_right)}, True),
    }


def run(quick, out, only=None):
    """Time every case (or those named in ``only`` and their baselines) and write the CSV."""
    s = SIZES["quick" if quick else "gpu"]
    device, dtype = flashattn.DEVICE, torch.bfloat16
    import triton

    meta = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat())
    rows, baselines = [], {}
    chosen = cases(s, device, dtype)
    if only:
        unknown = set(only) - set(chosen)
        if unknown:
            raise ValueError(f"--cases: unknown {sorted(unknown)}; expected some of {sorted(chosen)}")
        keep = set(only) | {chosen[name][0] for name in only}  # each with its baseline
        chosen = {name: case for name, case in chosen.items() if name in keep}
    for name, (baseline, inputs, ours, peers, compare) in chosen.items():
        times, diffs = {}, {}
        for provider, fn in (("flashattn", ours), *peers.items()):
            if fn is None:
                continue
            try:
                if compare and provider != "flashattn":
                    with torch.no_grad():
                        default = ours()  # flashattn as it runs by default, outside the provider's setting
                        with provider_setting(provider):
                            diffs[provider] = f"{max_diff(default, fn()):.3g}"
                with provider_setting(provider):
                    times[provider] = timed_modes(fn, inputs, quick)
            except AssertionError:
                raise
            except Exception as error:  # a peer that cannot run here is left out, said so
                if provider == "flashattn":
                    raise
                print(f"{name:>13} {provider:>10} left out: {type(error).__name__}: {str(error)[:200]}", flush=True)
        if name == baseline:
            baselines[name] = times
        for provider, modes in times.items():
            for mode, ms in modes.items():
                base = baselines.get(baseline, {}).get(provider, {}).get(mode, math.nan)
                ours_ms = times["flashattn"][mode]
                row = dict(meta, modification=name, provider=provider, mode=mode, ms=f"{ms:.4g}", baseline=baseline,
                           ratio_to_baseline=f"{ms / base:.3g}",
                           flashattn_speedup="" if provider == "flashattn" else f"{ms / ours_ms:.3g}",
                           max_diff=diffs.get(provider, ""))
                rows.append(row)
                print(f"{name:>13} {provider:>10} {mode:>8} {ms:9.4g} ms  x{ms / base:5.2f} of its {baseline:6}"
                      + (f"  flashattn {ms / ours_ms:5.2f}x as fast" if provider != "flashattn" else "")
                      + (f"  max_diff {row['max_diff']}" if row["max_diff"] else ""), flush=True)
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
    p.add_argument("--cases", help="comma-separated modifications to time (with their baselines); default all")
    args = p.parse_args(argv)
    if not args.quick and flashattn.DEVICE.type != "cuda":
        sys.exit("score_mods times kernels on a CUDA GPU; on a CPU run it with --quick")
    run(args.quick, args.out, args.cases.split(",") if args.cases else None)


if __name__ == "__main__":
    main()
