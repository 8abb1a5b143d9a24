"""Pictures of chapter 14: what a modification adds to the scores, drawn over the grid of tiles the
kernel reads it in (an ALiBi bias, a mask: -inf drawn as hidden), and the classes of a mask's tiles
(full, partial, empty) with the lists the kernels walk."""
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..gpu.runtime import DEVICE
from ..kernels import masks
from .ch03_05 import TILE_COLORS
from .common import axes_for, to_numpy

MASK_TILE_NAMES = {masks.EMPTY: "empty: never loaded", masks.PARTIAL: "partial: mask read",
                   masks.FULL: "full: no mask read"}


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


def _kept_unchanged(mask):
    """``(kept, unchanged)``, boolean arrays of the mask's pairs: kept (bool True, float not -inf)
    and left unchanged (bool True, float 0)."""
    mask = torch.as_tensor(mask).detach().cpu()
    if mask.dtype == torch.bool:
        return mask.numpy(), mask.numpy()
    mask = mask.double().numpy()
    return mask != -np.inf, mask == 0


def pair_tile_classes(mask, block_q, block_kv, is_causal=False):
    """The class of each tile of the ``(N_q, N_kv)`` mask ``mask`` (bool, or float: -inf hides, 0
    leaves a score unchanged), counted pair by pair under the forward's rules: for the mask, FULL
    where every pair is kept unchanged, EMPTY where none is kept; for the positions (the causal mask
    under ``is_causal``, the keys' end), FULL where every pair is visible and every key exists, EMPTY
    where no pair is visible; the tile's class is the lower of the two (EMPTY < PARTIAL < FULL), as
    ``kernels.masks.tile_lists`` combines them. Queries past N_q do not count."""
    kept, unchanged = _kept_unchanged(mask)
    n_q, n_kv = kept.shape
    seen = np.arange(n_q)[:, None] >= np.arange(n_kv)[None, :] if is_causal else np.ones((n_q, n_kv), bool)

    def kind(every, some):
        return masks.FULL if every else masks.PARTIAL if some else masks.EMPTY

    rows, cols = -(-n_q // block_q), -(-n_kv // block_kv)
    classes = np.empty((rows, cols), np.int8)
    for r in range(rows):
        for c in range(cols):
            tile = (slice(r * block_q, (r + 1) * block_q), slice(c * block_kv, (c + 1) * block_kv))
            whole = (c + 1) * block_kv <= n_kv
            classes[r, c] = min(kind(unchanged[tile].all(), kept[tile].any()),
                                kind(whole and seen[tile].all(), seen[tile].any()))
    return classes


def mask_tile_classes(mask, block_q, block_kv, is_causal=False, ax=None, title=None):
    """The tiles of the ``(N_q, N_kv)`` mask ``mask`` as the package summarises it for the forward
    (``kernels.masks``: ``mask_classes`` combined with ``structure_classes`` into ``tile_lists``),
    coloured full, partial or empty, the kept pairs shaded over them, and at the right of each row
    of tiles the list the kernel walks: the full tiles' indices, then the partial ones'.

    Asserts that the lists hold the classes the pairs give, counted one by one
    (:func:`pair_tile_classes`): the counts drawn are the ones the kernels read."""
    mask = torch.as_tensor(mask)
    n_q, n_kv = mask.shape
    on_device = mask.to(DEVICE)  # summarised where the kernels run (a Triton kernel reads it)
    classes = masks.mask_classes(on_device[None, None], n_q, n_kv, block_q, block_kv)
    structure = masks.structure_classes(n_q, n_kv, block_q, block_kv, is_causal, False, 0, 0, False, DEVICE)
    lists = masks.tile_lists(classes, structure, False)[0, 0].cpu().numpy()
    kinds = pair_tile_classes(mask, block_q, block_kv, is_causal)
    n_full, n_partial = lists[:, 0], lists[:, 1]
    full = [row[2:2 + n_full[r]].tolist() for r, row in enumerate(lists)]
    partial = [row[2 + n_full[r]:2 + n_full[r] + n_partial[r]].tolist() for r, row in enumerate(lists)]
    assert full == [np.flatnonzero(row == masks.FULL).tolist() for row in kinds], (full, kinds)
    assert partial == [np.flatnonzero(row == masks.PARTIAL).tolist() for row in kinds], (partial, kinds)

    ax = axes_for(ax, figsize=(0.16 * n_kv + 3.2, 0.16 * n_q + 1.2))
    order = (masks.EMPTY, masks.PARTIAL, masks.FULL)
    x_edges = np.minimum(np.arange(kinds.shape[1] + 1) * block_kv, n_kv)
    y_edges = np.minimum(np.arange(kinds.shape[0] + 1) * block_q, n_q)
    ax.pcolormesh(x_edges, y_edges, kinds, cmap=ListedColormap([TILE_COLORS[k] for k in order]), vmin=-0.5,
                  vmax=2.5, edgecolors="white", linewidth=1.0)
    kept, _ = _kept_unchanged(mask)
    if is_causal:
        kept = kept & (np.arange(n_q)[:, None] >= np.arange(n_kv)[None, :])
    ax.imshow(np.ma.masked_where(~kept, np.ones(kept.shape)), cmap=ListedColormap(["#1f4e79"]), vmin=0, vmax=1,
              alpha=0.45, extent=(0, n_kv, n_q, 0), interpolation="nearest", aspect="equal", zorder=3)
    for r in range(len(lists)):  # the row's list, as the kernel walks it
        ax.text(n_kv + 0.5, (y_edges[r] + y_edges[r + 1]) / 2, f"full {full[r]}, partial {partial[r]}",
                va="center", fontsize=7, clip_on=False)
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key j (BLOCK_KV = {block_kv})")
    ax.set_ylabel(f"query i (BLOCK_Q = {block_q})")
    loaded = int((n_full + n_partial).sum())
    ax.set_title(title or f"{loaded} of {kinds.size} tiles loaded, {int(n_full.sum())} without reading the mask",
                 fontsize=10)
    ax.legend(handles=[Patch(color=TILE_COLORS[k], label=MASK_TILE_NAMES[k]) for k in order[::-1]],
              loc="upper left", bbox_to_anchor=(0.0, -0.12), ncol=3, fontsize=7, frameon=False)
    return ax
