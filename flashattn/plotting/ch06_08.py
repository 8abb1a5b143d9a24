"""Pictures of chapters 06-08: who sums what in the backward pass (06), the tiles of its two
stages (07), and each case's error against the tolerance rule's bound (08)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..kernels import traversal
from .common import axes_for
from .ch03_05 import TILE_COLORS, TILE_NAMES, tile_kinds_map


def backward_ownership(n_q, n_kv, block_q, block_kv, q_block, kv_block, is_causal=True, axes=None):
    """Who sums what in the backward pass, on the N_q x N_kv grid of P.

    Left: the program that owns key block ``kv_block`` needs the whole COLUMN of P (and dS) under
    it, for both dV_j = sum_i P_ij dO_i and dK_j = scale * sum_i dS_ij Q_i; it visits the query
    tiles in the numbered order. Right: the program that owns query block ``q_block`` needs the
    whole ROW, for dQ_i = scale * sum_j dS_ij K_j. Hidden pairs (causal) are hatched."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    nqb, nkb = traversal.cdiv(n_q, block_q), traversal.cdiv(n_kv, block_kv)
    visible = (np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None]) if is_causal else np.ones((n_q, n_kv), bool)

    def tile_visible(qb, kb):
        return visible[qb * block_q:(qb + 1) * block_q, kb * block_kv:(kb + 1) * block_kv].any()

    panels = (
        (axes[0], [(qb, kv_block) for qb in range(nqb) if tile_visible(qb, kv_block)], "#2b6cb0",
         f"dK, dV of keys {kv_block * block_kv}..{min((kv_block + 1) * block_kv, n_kv) - 1}:\n"
         "sum DOWN a column of P and dS (over queries i)"),
        (axes[1], [(q_block, kb) for kb in range(nkb) if tile_visible(q_block, kb)], "#c05621",
         f"dQ of queries {q_block * block_q}..{min((q_block + 1) * block_q, n_q) - 1}:\n"
         "sum ALONG a row of P and dS (over keys j)"),
    )
    for ax, tiles, color, title in panels:
        ax.imshow(np.where(visible, 1.0, 0.0), cmap=ListedColormap(["#bdbdbd", "#f7f7f7"]), vmin=0, vmax=1,
                  extent=(0, n_kv, n_q, 0), interpolation="nearest")
        for x in range(0, n_kv + 1, block_kv):
            ax.axvline(min(x, n_kv), color="white", lw=1.5)
        for y in range(0, n_q + 1, block_q):
            ax.axhline(min(y, n_q), color="white", lw=1.5)
        for order, (qb, kb) in enumerate(tiles, start=1):
            x0, y0 = kb * block_kv, qb * block_q
            w, h = min(block_kv, n_kv - x0), min(block_q, n_q - y0)
            ax.add_patch(plt.Rectangle((x0, y0), w, h, color=color, alpha=0.55, lw=0))
            ax.text(x0 + w / 2, y0 + h / 2, str(order), ha="center", va="center", fontsize=9, color="white",
                    fontweight="bold")
        ax.set_xlim(0, n_kv)
        ax.set_ylim(n_q, 0)
        ax.set_aspect("equal")
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        ax.set_title(title, fontsize=10)
    axes[1].legend(handles=[Patch(facecolor="#f7f7f7", edgecolor="#999999", label="visible pair"),
                            Patch(color="#bdbdbd", label="hidden (causal)"),
                            Patch(color="#555555", alpha=0.55, label="tile visited (in order)")],
                   loc="lower left", fontsize=8, framealpha=0.9)
    return axes


def backward_tile_maps(n_q, n_kv, is_causal, dkdv_blocks=(16, 32), dq_blocks=(32, 16), axes=None):
    """The tiles of the two backward stages side by side, for one (batch, head).

    Left, the dK/dV stage (blocks ``(BLOCK_Q, BLOCK_KV) = dkdv_blocks``): one program per key block
    (a column) walks DOWN it, over the query blocks of :func:`flashattn.kernels.traversal.q_ranges`.
    Right, the dQ stage (``dq_blocks``): one program per query block (a row) walks ALONG it, over
    the key blocks of :func:`flashattn.kernels.traversal.kv_ranges`. Colours: full, masked or skipped."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    arrow = dict(arrowstyle="->", color="#1f4e79", lw=1.2, alpha=0.8)
    what = f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'not causal'}"
    bq, bkv = dkdv_blocks
    kinds = traversal.classify_blocks_dkdv(n_q, n_kv, bq, bkv, is_causal)
    tile_kinds_map(kinds, n_q, n_kv, bq, bkv, is_causal, ax=axes[0], legend=False)
    for kb in range(kinds.shape[1]):  # each program walks down its column, over the tiles it visits
        rows = np.flatnonzero(kinds[:, kb] != traversal.SKIPPED)
        if rows.size:
            x = (kb * bkv + min((kb + 1) * bkv, n_kv)) / 2
            axes[0].annotate("", xy=(x, min((rows[-1] + 1) * bq, n_q) - 1), xytext=(x, rows[0] * bq + 1),
                             arrowprops=arrow)
    axes[0].set_title(f"dK/dV stage: K, V resident, loop over\nquery blocks (down). {what}", fontsize=10)
    bq, bkv = dq_blocks
    kinds = traversal.classify_blocks(n_q, n_kv, bq, bkv, is_causal)
    tile_kinds_map(kinds, n_q, n_kv, bq, bkv, is_causal, ax=axes[1], legend=False)
    for qb in range(kinds.shape[0]):  # each program walks along its row
        cols = np.flatnonzero(kinds[qb] != traversal.SKIPPED)
        if cols.size:
            y = (qb * bq + min((qb + 1) * bq, n_q)) / 2
            axes[1].annotate("", xy=(min((cols[-1] + 1) * bkv, n_kv) - 1, y), xytext=(cols[0] * bkv + 1, y),
                             arrowprops=arrow)
    axes[1].set_title(f"dQ stage: Q resident, loop over\nkey blocks (along). {what}", fontsize=10)
    axes[1].legend(handles=[Patch(color=TILE_COLORS[k], label=TILE_NAMES[k]) for k in TILE_COLORS],
                   loc="upper right", fontsize=8, framealpha=0.9)
    return axes


def rule_ratios(labels, checks, ax=None, title="error / bound for each case (below 1 passes)"):
    """The tolerance rule over a sweep: for each case (one label and its list of
    :class:`flashattn.testing.rule.Check`), the ratio error / bound of every quantity, on a log scale,
    with the pass line at 1."""
    ax = axes_for(ax, (max(6, 0.55 * len(labels) + 2), 4))
    names = [c.name for c in checks[0]]
    x = np.arange(len(labels))
    markers = dict(out="o", lse="s", dq="^", dk="v", dv="D")
    for n, name in enumerate(names):
        ratios = [max(case[n].error / case[n].bound, 1e-6) if case[n].bound > 0 else np.nan for case in checks]
        ax.scatter(x + (n - (len(names) - 1) / 2) * 0.1, ratios, marker=markers.get(name, "o"), label=name, s=28)
    ax.axhline(1.0, color="crimson", lw=1.5, ls="--", label="bound")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("error / (factor x PyTorch's error + floor)\n(exact results drawn at 1e-6)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
