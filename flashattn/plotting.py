"""The course's pictures: tile maps, online-softmax traces, error heatmaps, memory and TFLOPS curves.

Each function draws into a matplotlib Axes (a new figure if none is given) and returns it, so the
notebooks and scripts/make_figures.py draw the same pictures from the same code.
"""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.patches import Patch

from . import traversal

TILE_COLORS = {traversal.SKIPPED: "#d9d9d9", traversal.MASKED: "#f2b134", traversal.FULL: "#3a9e5f"}
TILE_NAMES = {traversal.SKIPPED: "skipped", traversal.MASKED: "masked", traversal.FULL: "full"}


def _axes(ax, figsize=(5, 4)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _numpy(x):
    return x.detach().double().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=float)


def tile_map(n_q, n_kv, block_q, block_kv, is_causal=True, ax=None, title=None):
    """The forward kernel's tiles for one (batch, head): full, masked or skipped, drawn to scale,
    with the causal boundary over them and the fraction of tiles computed in the title."""
    ax = _axes(ax)
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    cmap = ListedColormap([TILE_COLORS[k] for k in (traversal.SKIPPED, traversal.MASKED, traversal.FULL)])
    # Draw in element coordinates so that ragged last blocks appear smaller, as they are.
    x_edges = np.minimum(np.arange(kinds.shape[1] + 1) * block_kv, n_kv)
    y_edges = np.minimum(np.arange(kinds.shape[0] + 1) * block_q, n_q)
    ax.pcolormesh(x_edges, y_edges, kinds, cmap=cmap, vmin=-0.5, vmax=2.5, edgecolors="white",
                  linewidth=1.0)
    if is_causal:
        ax.plot([0, min(n_q, n_kv)], [0, min(n_q, n_kv)], color="black", lw=1.2, ls="--")
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key position j (BLOCK_KV = {block_kv})")
    ax.set_ylabel(f"query position i (BLOCK_Q = {block_q})")
    done = traversal.work_fraction(kinds)
    ax.set_title(title or f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'full'}: "
                 f"{done:.0%} of tiles computed", fontsize=10)
    ax.legend(handles=[Patch(color=TILE_COLORS[k], label=TILE_NAMES[k]) for k in TILE_COLORS],
              loc="upper right", fontsize=8, framealpha=0.9)
    return ax


def softmax_trace(x_row, block, ax=None):
    """How the online softmax of one row evolves block by block: running max M, running sum L
    and the correction factor alpha applied to everything accumulated before."""
    import torch

    from .reference import online_softmax_trace

    trace = online_softmax_trace(torch.as_tensor(x_row, dtype=torch.float64), block)
    blocks = np.arange(1, trace["M"].shape[0] + 1)
    if ax is None:
        _, ax = plt.subplots(1, 3, figsize=(12, 3.2))
    for a, name, label in zip(ax, ("M", "L", "alpha"),
                              ("running max M", "running sum L", "correction alpha = exp(M_old - M_new)")):
        a.plot(blocks, _numpy(trace[name]), marker="o")
        a.set_xlabel("blocks seen")
        a.set_title(label, fontsize=10)
        a.set_xticks(blocks)
    ax[0].plot(blocks, _numpy(trace["block_max"]), marker="x", ls=":", color="gray", label="max of the block")
    ax[0].legend(fontsize=8)
    ax[2].set_ylim(-0.05, 1.05)
    return ax


def error_heatmap(ours, ref, ax=None, title=None, vmin=None, vmax=None):
    """|ours - ref| for one (batch, head) over sequence position x head dim, log colour scale."""
    ax = _axes(ax, (4, 3.5))
    err = np.abs(_numpy(ours) - _numpy(ref))
    floor = 1e-12
    im = ax.imshow(np.maximum(err, floor), aspect="auto", interpolation="nearest", cmap="magma",
                   norm=LogNorm(vmin=vmin or max(err.min(), floor), vmax=vmax or max(err.max(), 2 * floor)))
    ax.figure.colorbar(im, ax=ax, label="|ours - reference|")
    ax.set_xlabel("head dim d")
    ax.set_ylabel("sequence position")
    ax.set_title(title or f"max error {err.max():.1e}", fontsize=10)
    return ax


def error_heatmaps(panels, ncols=None, shared_scale=True, figsize_per=(3.6, 3.0)):
    """Several heatmaps side by side: ``panels`` maps a title to ``(ours, ref)``. With
    ``shared_scale`` the colour scale is common, so the panels can be compared by eye."""
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(figsize_per[0] * ncols, figsize_per[1] * nrows),
                             squeeze=False)
    errs = [np.abs(_numpy(o) - _numpy(r)) for o, r in panels.values()]
    vmin = max(min(e.min() for e in errs), 1e-12) if shared_scale else None
    vmax = max(max(e.max() for e in errs), 2e-12) if shared_scale else None
    for ax, (title, (ours, ref)) in zip(axes.flat, panels.items()):
        error_heatmap(ours, ref, ax=ax, vmin=vmin, vmax=vmax,
                      title=f"{title}\nmax {np.abs(_numpy(ours) - _numpy(ref)).max():.1e}")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def memory_curve(seq_lens, series, ax=None, title="Memory for one (batch, head)"):
    """Bytes against sequence length on log-log axes; ``series`` maps a label to byte counts."""
    ax = _axes(ax, (5.5, 4))
    for label, values in series.items():
        ax.loglog(seq_lens, values, marker="o", label=label)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("bytes")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def tflops_curves(rows, ax=None, title=None):
    """TFLOPS against sequence length, one line per provider. ``rows`` are dicts (or CSV rows)
    with at least ``provider``, ``seq_len`` and ``tflops`` for one setting."""
    ax = _axes(ax, (6, 4))
    providers = sorted({r["provider"] for r in rows}, key=lambda p: (p != "flashattn", p))
    for provider in providers:
        pts = sorted((int(r["seq_len"]), float(r["tflops"])) for r in rows if r["provider"] == provider)
        x, y = zip(*pts)
        ax.plot(x, y, marker="o", lw=2.5 if provider == "flashattn" else 1.2, label=provider)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOPS")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax
