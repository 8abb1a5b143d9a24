"""Pictures of chapter 14: what a modification adds to the scores, drawn over the grid of tiles the
kernel reads it in (an ALiBi bias, a mask: -inf drawn as hidden)."""
import matplotlib.pyplot as plt
import numpy as np

from .common import axes_for, to_numpy


def score_tile(values, tile=4, ax=None, title=None):
    """The ``(N_q, N_kv)`` matrix ``values`` (a bias, or a mask as 0 / -inf) as a heatmap, every
    entry numbered, hidden entries (-inf) hatched, with the ``tile x tile`` grid of the kernel's
    tiles drawn over it."""
    ax = axes_for(ax, figsize=(0.55 * values.shape[-1] + 1.5, 0.55 * values.shape[-2] + 1))
    grid = to_numpy(values)
    hidden = np.isinf(grid) & (grid < 0)
    shown = np.ma.masked_array(grid, hidden)
    image = ax.imshow(shown, cmap="viridis", aspect="equal")
    if shown.count() and shown.max() > shown.min():  # a scale only where the values differ
        plt.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    n_q, n_kv = grid.shape
    for i in range(n_q):
        for j in range(n_kv):
            if hidden[i, j]:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", color="0.6"))
            else:
                ax.text(j, i, f"{grid[i, j] + 0.0:g}", ha="center", va="center", fontsize=7, color="white")
    for edge in range(0, n_kv + 1, tile):
        ax.axvline(edge - 0.5, color="red", lw=1.5)
    for edge in range(0, n_q + 1, tile):
        ax.axhline(edge - 0.5, color="red", lw=1.5)
    ax.set_xticks(range(n_kv))
    ax.set_yticks(range(n_q))
    ax.set_xlim(-0.5, n_kv - 0.5)
    ax.set_ylim(n_q - 0.5, -0.5)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.set_title(title or f"added to the scores, in tiles of {tile} x {tile}")
    return ax


def score_tiles(matrices, titles, tile=4):
    """Several :func:`score_tile` panels side by side; returns the figure."""
    fig, axes = plt.subplots(1, len(matrices), figsize=(0.6 * matrices[0].shape[-1] * len(matrices) + 2,
                                                          0.6 * matrices[0].shape[-2] + 1.5))
    for ax, matrix, title in zip(np.atleast_1d(axes), matrices, titles):
        score_tile(matrix, tile=tile, ax=ax, title=title)
    fig.tight_layout()
    return fig
