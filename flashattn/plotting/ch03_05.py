"""Pictures of chapters 03-05: the tiles of S (full, masked, skipped), which pairs exist, the
fraction of tiles computed, the launch order and its schedule (03), tables of indices and the
error of a kernel against its reference (04, 05)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.patches import Patch

from ..kernels import traversal
from .common import axes_for, to_numpy

TILE_COLORS = {traversal.SKIPPED: "#d9d9d9", traversal.MASKED: "#f2b134", traversal.FULL: "#3a9e5f"}
TILE_NAMES = {traversal.SKIPPED: "skipped", traversal.MASKED: "masked", traversal.FULL: "full"}

def tile_map(n_q, n_kv, block_q, block_kv, is_causal=True, ax=None, title=None):
    """The forward kernel's tiles for one (batch, head): full, masked or skipped, drawn to scale,
    with the causal boundary over them and the fraction of tiles computed in the title."""
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    done = traversal.work_fraction(kinds)
    return tile_kinds_map(kinds, n_q, n_kv, block_q, block_kv, is_causal, ax=ax, title=title or (
        f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'not causal'}: {done:.0%} of tiles computed"))


def tile_kinds_map(kinds, n_q, n_kv, block_q, block_kv, is_causal=False, ax=None, title=None,
                   wrong=None, legend=True):
    """Draw any map of tile kinds (``FULL``, ``MASKED``, ``SKIPPED``, shape (query blocks, key
    blocks)), for instance one a learner computed, the way :func:`tile_map` draws the kernel's.
    ``wrong`` (a boolean array of the same shape) outlines those tiles in red."""
    ax = axes_for(ax)
    kinds = np.asarray(kinds)
    cmap = ListedColormap([TILE_COLORS[k] for k in (traversal.SKIPPED, traversal.MASKED, traversal.FULL)])
    x_edges = np.minimum(np.arange(kinds.shape[1] + 1) * block_kv, n_kv)
    y_edges = np.minimum(np.arange(kinds.shape[0] + 1) * block_q, n_q)
    shown = np.where(np.isin(kinds, list(TILE_COLORS)), kinds, traversal.SKIPPED)
    ax.pcolormesh(x_edges, y_edges, shown, cmap=cmap, vmin=-0.5, vmax=2.5, edgecolors="white",
                  linewidth=1.0)
    if wrong is not None:
        for qb, kb in zip(*np.nonzero(np.asarray(wrong))):
            ax.add_patch(plt.Rectangle((x_edges[kb], y_edges[qb]), x_edges[kb + 1] - x_edges[kb],
                                       y_edges[qb + 1] - y_edges[qb], fill=False, ec="red", lw=2.5))
    if is_causal:
        ax.plot([0, min(n_q, n_kv)], [0, min(n_q, n_kv)], color="black", lw=1.2, ls="--")
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key position j (BLOCK_KV = {block_kv})")
    ax.set_ylabel(f"query position i (BLOCK_Q = {block_q})")
    ax.set_title(title or f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'not causal'}",
                 fontsize=10)
    if legend:
        ax.legend(handles=[Patch(color=TILE_COLORS[k], label=TILE_NAMES[k]) for k in TILE_COLORS],
                  loc="upper right", fontsize=8, framealpha=0.9)
    return ax


def visibility_map(n_q, n_kv, block_q, block_kv, is_causal=True, ax=None, title=None):
    """Which (query i, key j) pairs exist, element by element (dark: query i sees key j), with the
    tile boundaries drawn over them: the picture a tile map summarises."""
    ax = axes_for(ax)
    i = np.arange(n_q)[:, None]
    j = np.arange(n_kv)[None, :]
    visible = (j <= i) if is_causal else np.ones((n_q, n_kv), bool)
    ax.imshow(visible, cmap=ListedColormap(["#f7f7f7", "#1f4e79"]), vmin=0, vmax=1,
              extent=(0, n_kv, n_q, 0), interpolation="nearest")
    for x in range(0, n_kv + 1, block_kv):
        ax.axvline(x, color="#e07b00", lw=0.9)
    for y in range(0, n_q + 1, block_q):
        ax.axhline(y, color="#e07b00", lw=0.9)
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key position j (BLOCK_KV = {block_kv})")
    ax.set_ylabel(f"query position i (BLOCK_Q = {block_q})")
    ax.set_title(title or f"pairs (i, j) that exist: {'j <= i' if is_causal else 'all'}", fontsize=10)
    ax.legend(handles=[Patch(color="#1f4e79", label="query sees key"),
                       Patch(color="#f7f7f7", label="hidden", ec="gray"),
                       Patch(color="#e07b00", label="tile edges")],
              loc="upper right", fontsize=8, framealpha=0.9)
    return ax


def work_fraction_curve(seq_lens, series, ax=None, title="Tiles computed, causal", limit=0.5):
    """Fraction of the tiles computed against sequence length, one line per label in ``series``
    (label -> fractions), with the limit the fractions approach drawn as a dashed line."""
    ax = axes_for(ax, (6, 4))
    for label, values in series.items():
        ax.plot(seq_lens, values, marker="o", ms=3, label=label)
    if limit is not None:
        ax.axhline(limit, color="black", ls="--", lw=1, label=f"limit {limit:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (N_q = N_kv)")
    ax.set_ylabel("fraction of the N_q x N_kv tiles computed")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def launch_strips(orders, wave=None, ax=None, title="Which head each program works on, in launch order",
                  value_name="head"):
    """One strip per launch order: ``orders`` maps a label to the value (e.g. the head) of each
    program in the order the programs start. ``wave`` marks how many run at once."""
    ax = axes_for(ax, (10, 0.5 + 0.7 * len(orders)))
    labels = list(orders)
    data = np.array([np.asarray(orders[k]) for k in labels], dtype=float)
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="tab20",
                   vmin=-0.5, vmax=max(19.5, data.max() + 0.5))
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("launch order (linear program index)")
    if wave is not None:
        ax.axvline(wave - 0.5, color="black", lw=2)
        title = f"{title}\n(left of the black line: the first {wave} programs, running together)"
    ax.figure.colorbar(im, ax=ax, label=value_name, fraction=0.03, pad=0.01)
    ax.set_title(title, fontsize=10)
    return ax


def gantt(jobs, n_workers, ax=None, title=None):
    """Programs on the processors that run them: ``jobs`` is a list of (worker, start, length,
    label) and each becomes a labelled bar. The time the last one ends is in the title."""
    ax = axes_for(ax, (8, 0.6 + 0.45 * n_workers))
    colors = plt.get_cmap("viridis")
    longest = max(length for _, _, length, _ in jobs)
    for worker, start, length, label in jobs:
        ax.barh(worker, length, left=start, color=colors(0.15 + 0.7 * length / longest),
                edgecolor="white")
        ax.text(start + length / 2, worker, str(label), ha="center", va="center", fontsize=7,
                color="white")
    end = max(start + length for _, start, length, _ in jobs)
    ax.set_yticks(range(n_workers), [f"SM {w}" for w in range(n_workers)])
    ax.invert_yaxis()
    ax.set_xlabel("time (in tiles processed)")
    ax.set_title(f"{title + ': ' if title else ''}all done at t = {end:g}", fontsize=10)
    ax.axvline(end, color="red", lw=1, ls="--")
    return ax


def int_table(values, ax=None, title=None, valid=None, fmt="{:d}", xlabel="column", ylabel="row"):
    """A small integer matrix drawn as a table of numbers (offsets, program ids, indices).
    Cells where ``valid`` is False are greyed out (masked elements)."""
    values = np.asarray(values)
    ax = axes_for(ax, (0.45 * values.shape[1] + 1.2, 0.4 * values.shape[0] + 0.9))
    ok = np.ones(values.shape, bool) if valid is None else np.asarray(valid, bool)
    ax.imshow(np.where(ok, 1.0, 0.0), cmap=ListedColormap(["#bdbdbd", "#e8f1fa"]), vmin=0, vmax=1,
              aspect="auto", interpolation="nearest")
    for (r, c), v in np.ndenumerate(values):
        ax.text(c, r, fmt.format(v.item()), ha="center", va="center", fontsize=8,
                color="black" if ok[r, c] else "#6f6f6f")
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(values.shape[0]))
    ax.tick_params(labelsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def error_heatmap(ours, ref, ax=None, title=None, vmin=None, vmax=None):
    """|ours - ref| for one (batch, head) over sequence position x head dim, log colour scale."""
    ax = axes_for(ax, (4, 3.5))
    err = np.abs(to_numpy(ours) - to_numpy(ref))
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
    errs = [np.abs(to_numpy(o) - to_numpy(r)) for o, r in panels.values()]
    vmin = max(min(e.min() for e in errs), 1e-12) if shared_scale else None
    vmax = max(max(e.max() for e in errs), 2e-12) if shared_scale else None
    for ax, (title, (ours, ref)) in zip(axes.flat, panels.items()):
        error_heatmap(ours, ref, ax=ax, vmin=vmin, vmax=vmax,
                      title=f"{title}\nmax {np.abs(to_numpy(ours) - to_numpy(ref)).max():.1e}")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig
