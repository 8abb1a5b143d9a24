"""Pictures of chapter 10: which pairs a sliding window keeps and the tile map it gives, the
programs of a packed variable-length batch against the padded grid, and the H200's measurements of
the three variants."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..kernels import traversal
from ..testing import reference
from .ch03_05 import tile_kinds_map
from .common import axes_for


def window_tile_kinds(n_q, n_kv, block_q, block_kv, window_size=(-1, -1), is_causal=False):
    """The tile map of a window, from the pairs themselves (``reference.window_mask``): ``FULL`` when every pair of the tile
    exists, ``SKIPPED`` when none does, ``MASKED`` otherwise. Rows past n_q count (a block computes
    all its rows, chapter 03); keys past n_kv do not exist."""
    rows = traversal.cdiv(n_q, block_q) * block_q
    seen = np.zeros((rows, traversal.cdiv(n_kv, block_kv) * block_kv), bool)
    seen[:, :n_kv] = reference.window_mask(rows, n_kv, window_size, is_causal).numpy()
    tiles = seen.reshape(rows // block_q, block_q, -1, block_kv)
    every, some = tiles.all(axis=(1, 3)), tiles.any(axis=(1, 3))
    return np.where(every, traversal.FULL, np.where(some, traversal.MASKED, traversal.SKIPPED)).astype(np.int8)


def _window_name(window_size, is_causal):
    return f"window_size={tuple(window_size)}{', causal' if is_causal else ''}"


def window_tile_map(n_q, n_kv, block_q, block_kv, window_size=(-1, -1), is_causal=False, ax=None, title=None,
                    show_pairs=True, legend=True):
    """The tiles a window leaves (full, masked, skipped), with the window's pairs shaded over them
    and the fraction of tiles visited in the title."""
    kinds = window_tile_kinds(n_q, n_kv, block_q, block_kv, window_size, is_causal)
    visited = (kinds != traversal.SKIPPED).sum()
    ax = tile_kinds_map(kinds, n_q, n_kv, block_q, block_kv, False, ax=ax, legend=legend, title=title or (
        f"{_window_name(window_size, is_causal)}\n{visited} of {kinds.size} tiles visited"))
    if show_pairs:
        seen = reference.window_mask(n_q, n_kv, window_size, is_causal).numpy()
        shade = np.ma.masked_where(~seen, np.ones(seen.shape))
        ax.imshow(shade, cmap=ListedColormap(["#1f4e79"]), vmin=0, vmax=1, alpha=0.45, extent=(0, n_kv, n_q, 0),
                  interpolation="nearest", aspect="equal", zorder=3)
        ax.set_xlim(0, n_kv)
        ax.set_ylim(n_q, 0)
    return ax


def tiles_against_n(seq_lens, series, ax=None, title="Tiles visited against N"):
    """How many tiles a (batch, head) visits against N, one line per label of ``series``, on log-log
    axes with dotted guides of slope 1 and 2 (visits growing like N and like N^2)."""
    ax = axes_for(ax, (6, 4))
    for label, counts in series.items():
        ax.plot(seq_lens, counts, marker="o", ms=3, label=label)
    first = min(c[0] for c in series.values())
    n = np.asarray(seq_lens, float)
    ax.plot(n, first * n / n[0], color="gray", ls=":", lw=1, label="slope 1 (~N)")
    ax.plot(n, first * (n / n[0]) ** 2, color="black", ls=":", lw=1, label="slope 2 (~N^2)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length N (N_q = N_kv)")
    ax.set_ylabel("tiles visited")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def _sequence_colors(n):
    cmap = plt.get_cmap("tab10")
    return [cmap(b % 10) for b in range(n)]


def varlen_programs(cu_seqlens, table, block_q, ax=None, title=None):
    """The packed rows of a variable-length batch (one colour per sequence) and the programs of
    ``table`` (rows ``(sequence, first packed row)``) drawn over them as boxes, each labelled with
    its program index: no box crosses from one sequence into the next."""
    cu = [int(x) for x in cu_seqlens]
    colors = _sequence_colors(len(cu) - 1)
    ax = axes_for(ax, (11, 2.2))
    for b, (lo, hi) in enumerate(zip(cu, cu[1:])):
        if hi > lo:
            ax.barh(1, hi - lo, left=lo, height=0.8, color=colors[b], alpha=0.45, edgecolor="black", lw=0.5)
            ax.text((lo + hi) / 2, 1, f"seq {b}\n{hi - lo} rows", ha="center", va="center", fontsize=7)
    for p, (b, start) in enumerate(np.asarray(table).tolist()):
        end = min(start + block_q, cu[b + 1])
        ax.barh(0, end - start, left=start, height=0.8, color=colors[b], edgecolor="black", lw=0.8)
        ax.text((start + end) / 2, 0, str(p), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([0, 1], ["programs", "sequences"])
    ax.set_xlim(0, max(cu[-1], 1))
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("packed row (token) index, 0 .. total - 1")
    ax.set_title(title or f"{len(table)} programs of BLOCK_Q = {block_q} rows over {cu[-1]} packed tokens",
                 fontsize=10)
    return ax


def padded_blocks(lengths, block_q, ax=None, title=None):
    """The padded batch's query blocks, one row per sequence and one column per block of the
    longest sequence: the blocks holding real tokens, and those holding only padding, which a
    padded launch computes all the same."""
    n_blocks = traversal.cdiv(max(lengths), block_q)
    real = np.array([[k * block_q < n for k in range(n_blocks)] for n in lengths])
    ax = axes_for(ax, (0.25 * n_blocks + 2, 0.3 * len(lengths) + 1.2))
    ax.imshow(real, cmap=ListedColormap(["#d9d9d9", "#3a9e5f"]), vmin=0, vmax=1, aspect="auto",
              interpolation="nearest")
    ax.set_xlabel(f"query block (BLOCK_Q = {block_q})")
    ax.set_ylabel("sequence")
    ax.set_yticks(range(len(lengths)))
    ax.legend(handles=[Patch(color="#3a9e5f", label="real tokens"), Patch(color="#d9d9d9", label="padding only")],
              loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_title(title or f"padded to {max(lengths)} tokens: {real.sum()} of {real.size} query blocks hold tokens",
                 fontsize=10)
    return ax


def measured_bars(rows, labels, value="ms", ax=None, title=None, unit="ms"):
    """Bars of one column of recorded benchmark rows: ``labels`` maps a bar's label to the row it
    shows; the value is written on each bar."""
    ax = axes_for(ax, (6, 3))
    names = list(labels)
    values = [float(labels[name][value]) for name in names]
    bars = ax.barh(range(len(names)), values, color=plt.get_cmap("tab10")(np.arange(len(names)) % 10))
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.3g}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_title(title or value, fontsize=10)
    return ax


def window_times(rows, mode="fwd", ax=None, title=None):
    """The recorded times of the window benchmark against N (provider ``flashattn-window``), with
    causal and full attention where they were measured, on log-log axes."""
    ax = axes_for(ax, (6, 4))
    for provider, style in [("flashattn-window", dict(marker="o")), ("flashattn-causal", dict(marker="s", ls="")),
                            ("flashattn-full", dict(marker="^", ls="")), ("sdpa-causal", dict(marker="x", ls=""))]:
        mine = sorted((int(r["setting"].rsplit("N ", 1)[1]), float(r["ms"])) for r in rows
                      if r["provider"] == provider and r["mode"] == mode)
        if mine:
            ax.plot(*zip(*mine), label=provider, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(f"{mode} time (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"{mode} time against N", fontsize=10)
    return ax
