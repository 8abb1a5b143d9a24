"""Draw the README's pictures into figures/, with the same plotting functions the notebooks call.

    python tools/make_figures.py

Runs on a CPU (the error heatmaps launch the real forward kernel through Triton's interpreter on
small inputs); the GPU measurements come from figures/data/, recorded on an H200.
"""
import csv
import os

import flashattn  # first: it picks the runtime
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from flashattn import plotting
from flashattn.measure import bench
from flashattn.testing import reference  # noqa: E402
from flashattn.kernels.forward import attention_forward  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

FIGURES = os.path.join(ROOT, "figures")
DATA = os.path.join(FIGURES, "data")


def save(fig, name):
    path = os.path.join(FIGURES, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print("wrote", os.path.relpath(path, ROOT))


def tile_maps():
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    plotting.tile_map(256, 256, 64, 32, is_causal=True, ax=axes[0])
    plotting.tile_map(200, 200, 64, 32, is_causal=True, ax=axes[1])
    plotting.tile_map(100, 230, 32, 32, is_causal=True, ax=axes[2])
    fig.suptitle("Which tiles the forward kernel visits: full tiles need no mask, masked tiles sit on "
                 "the diagonal or the ragged end, skipped tiles are never loaded", fontsize=11)
    save(fig, "tile_maps.png")


def softmax_trace():
    g = torch.Generator().manual_seed(3)
    row = torch.randn(64, generator=g, dtype=torch.float64) * 2
    row[20:24] += 6  # a jump in the max halfway through, so that alpha visibly rescales
    axes = plotting.softmax_trace(row, 8)
    fig = axes[0].figure
    fig.suptitle("Online softmax of one row, 8 scores at a time", fontsize=11, y=1.05)
    save(fig, "online_softmax_trace.png")


def error_heatmaps():
    panels = {}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for n, causal in ((128, False), (113, True)):
            q, k, v = (torch.randn(1, 1, n, 64, generator=g).to(dtype) for _ in range(3))
            out, _ = attention_forward(q, k, v, causal, 64 ** -0.5)
            ref, _ = reference.naive_attention(q.double(), k.double(), v.double(), is_causal=causal)
            name = str(dtype).replace("torch.", "")
            panels[f"{name}, N={n}, {'causal' if causal else 'not causal'}"] = (out[0, 0], ref[0, 0])
    fig = plotting.error_heatmaps(panels, ncols=4)
    fig.suptitle(f"|flashattn forward - float64 reference| ({flashattn.RUNTIME})", fontsize=11, y=1.04)
    save(fig, "error_heatmaps.png")


def memory():
    with open(os.path.join(DATA, "h200_memory.csv")) as f:
        rows = list(csv.DictReader(f))
    lens = sorted({int(r["seq_len"]) for r in rows})
    series = {p: [float(r["peak_mib"]) * 2**20 for n in lens for r in rows
                  if r["provider"] == p and int(r["seq_len"]) == n]
              for p in ("naive", "sdpa", "flashattn")}
    ax = plotting.memory_curve(lens, series, title=f"Peak memory of forward + backward, {rows[0]['heads']} "
                               f"heads, head dim {rows[0]['head_dim']}, bf16, causal ({rows[0]['gpu']})")
    save(ax.figure, "memory.png")


def ladder():
    with open(os.path.join(DATA, "h200_ladder.csv")) as f:
        rows = list(csv.DictReader(f))
    steps = list(dict.fromkeys(r["step"] for r in rows))
    values = {label: [float(next(r["tflops"] for r in rows if r["step"] == s and r["mode"] == mode))
                      for s in steps] for label, mode in (("forward", "fwd"), ("backward", "bwd"))}
    ax = plotting.ladder_bars(steps, values, title=f"From the starting configuration to the tuned kernel "
                              f"({rows[0]['gpu']}, causal, head dim {rows[0]['head_dim']}, N={rows[0]['n']})")
    save(ax.figure, "ladder.png")


def tflops():  # the README's figures: the package as it runs by default (Gluon kernels on Hopper)
    with open(os.path.join(DATA, "h200_bench_default.csv")) as f:
        for path in bench.plot(list(csv.DictReader(f)), FIGURES):
            print("wrote", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    tile_maps()
    softmax_trace()
    error_heatmaps()
    memory()
    ladder()
    tflops()
