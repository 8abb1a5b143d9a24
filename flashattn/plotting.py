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
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    done = traversal.work_fraction(kinds)
    return tile_kinds_map(kinds, n_q, n_kv, block_q, block_kv, is_causal, ax=ax, title=title or (
        f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'not causal'}: {done:.0%} of tiles computed"))


def softmax_trace(x_row, block, ax=None):
    """How the online softmax of one row evolves block by block.

    Four panels (when ``ax`` is None or holds four axes): the row itself, shaded block by block,
    with each block's max and the running max M over it; then, after each block, the running max M,
    the running sum L and the correction factor alpha = exp(M_old - M_new) that rescaled everything
    accumulated before. The blocks where M rose (alpha < 1) are marked in red in every panel. Given
    three axes, the row panel is left out."""
    import torch

    from .reference import online_softmax_trace

    x = torch.as_tensor(x_row, dtype=torch.float64).reshape(-1)
    trace = online_softmax_trace(x, block)
    n, n_blocks = x.shape[0], trace["M"].shape[0]
    blocks = np.arange(1, n_blocks + 1)
    rose = _numpy(trace["alpha"]) < 1
    if ax is None:
        _, ax = plt.subplots(1, 4, figsize=(15, 3.3), gridspec_kw=dict(width_ratios=[1.5, 1, 1, 1]))
    ax = list(np.ravel(ax))
    if len(ax) == 4:
        row_ax, ax = ax[0], ax[1:]
        xs = _numpy(x)
        for b in range(n_blocks):
            lo, hi = b * block, min((b + 1) * block, n)
            row_ax.axvspan(lo - 0.5, hi - 0.5, color="#eef3f8" if b % 2 == 0 else "white", zorder=0)
            bmax, m = _numpy(trace["block_max"][b]), _numpy(trace["M"][b])
            row_ax.hlines(bmax, lo - 0.4, hi - 0.6, color="gray", lw=1, ls=":",
                          label="max of the block" if b == 0 else None)
            row_ax.hlines(m, lo - 0.5, hi - 0.5, color="#c0392b" if rose[b] else "#1f4e79", lw=2,
                          label="running max M" if b == 0 else None)
        row_ax.plot(np.arange(n), xs, "o", ms=3, color="black", label="x_j")
        row_ax.set_xlabel(f"position j in the row (blocks of {block})")
        row_ax.set_title("the row x, streamed block by block", fontsize=10)
        row_ax.legend(fontsize=7, loc="best", framealpha=0.9)
    for a, name, label in zip(ax, ("M", "L", "alpha"),
                              ("running max M", "running sum L",
                               "correction alpha = exp(M_old - M_new)")):
        values = _numpy(trace[name])
        a.plot(blocks, values, marker="o", color="#1f4e79")
        a.plot(blocks[rose], values[rose], "o", color="#c0392b", label="M rose here" if name == "alpha" else None)
        a.set_xlabel("blocks seen")
        a.set_title(label, fontsize=10)
        a.set_xticks(blocks)
    ax[0].plot(blocks, _numpy(trace["block_max"]), marker="x", ls=":", color="gray", label="max of the block")
    ax[0].legend(fontsize=8)
    ax[2].set_ylim(-0.05, 1.05)
    ax[2].legend(fontsize=8, loc="lower right")
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


# --- Chapters 00-02: small matrices, memory sizes, exponent ranges -------------------------------

def matrix_panels(panels, fmt="{:.2f}", cmap="viridis", figsize_per=(3.0, 2.8), suptitle=None):
    """Small matrices side by side, each cell coloured and labelled with its value.

    ``panels`` maps a title to a 2-D tensor/array, or to ``(matrix, (row_label, col_label))``.
    Cells holding -inf (masked scores) are drawn grey and labelled "-inf"; the colour scale of each
    panel covers its finite values. Returns the figure."""
    fig, axes = plt.subplots(1, len(panels), figsize=(figsize_per[0] * len(panels), figsize_per[1]),
                             squeeze=False)
    for ax, (title, value) in zip(axes[0], panels.items()):
        matrix, (row_label, col_label) = value if isinstance(value, tuple) else (value, ("row", "column"))
        arr = np.atleast_2d(_numpy(matrix))
        finite = np.isfinite(arr)
        colours = plt.get_cmap(cmap).copy()
        colours.set_bad("#cfcfcf")
        ax.imshow(np.ma.masked_where(~finite, arr), cmap=colours, aspect="auto",
                  vmin=arr[finite].min() if finite.any() else 0, vmax=arr[finite].max() if finite.any() else 1)
        lo, hi = (arr[finite].min(), arr[finite].max()) if finite.any() else (0.0, 1.0)
        for (i, j), x in np.ndenumerate(arr):
            text = fmt.format(x) if np.isfinite(x) else ("-inf" if x < 0 else str(x))
            dark = np.isfinite(x) and (x - lo) < 0.5 * (hi - lo)
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        ax.set_xticks(range(arr.shape[1]))
        ax.set_yticks(range(arr.shape[0]))
        ax.set_xlabel(col_label)
        ax.set_ylabel(row_label)
        ax.set_title(f"{title}  {arr.shape[0]}x{arr.shape[1]}", fontsize=10)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig


def partial_outputs(estimates, final, ax=None, title="O estimated from the blocks seen so far"):
    """How the output row converges as blocks stream in: ``estimates`` is (n_blocks, D), the
    normalised output acc / L after each block; ``final`` (D,) the exact output, drawn dashed."""
    ax = _axes(ax, (6, 3.6))
    est, fin = _numpy(estimates), _numpy(final).reshape(-1)
    blocks = np.arange(1, est.shape[0] + 1)
    for d in range(est.shape[1]):
        line, = ax.plot(blocks, est[:, d], marker="o", label=f"O[{d}]")
        ax.axhline(fin[d], color=line.get_color(), ls="--", lw=1, alpha=0.7)
    ax.set_xticks(blocks)
    ax.set_xlabel("blocks seen")
    ax.set_ylabel("acc / L")
    ax.set_title(title + " (dashed: exact)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=min(est.shape[1], 4))
    return ax


def _bytes_label(n):
    """Bytes in binary units: KiB = 1024 bytes, MiB = 1024**2, GiB = 1024**3, TiB = 1024**4."""
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def capacity_ladder(levels, marks=None, ax=None, title="Where does a tensor fit?"):
    """Memory sizes as horizontal bars on a log axis (``levels`` maps a name, which should state
    the size as its source gives it, to bytes), with vertical lines at the sizes of some tensors
    (``marks`` maps a label to bytes, shown in KiB/MiB/GiB), so that one can see at a glance which
    level of the memory hierarchy can hold them."""
    ax = _axes(ax, (8, 0.6 * len(levels) + 1.8))
    names = list(levels)
    values = [levels[n] for n in names]
    ax.barh(range(len(names)), values, color="#7fa7c9", edgecolor="#1f4e79")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    colours = ["#c0392b", "#e67e22", "#8e44ad", "#16a085", "#2c3e50"]
    for i, (label, size) in enumerate((marks or {}).items()):
        c = colours[i % len(colours)]
        ax.axvline(size, color=c, lw=1.8, ls="--", label=f"{label}: {_bytes_label(size)}")
    lo = min(values + list((marks or {}).values()))
    hi = max(values + list((marks or {}).values()))
    ax.set_xlim(lo / 3, hi * 30)
    ax.set_xlabel("bytes (log scale)")
    ax.set_title(title, fontsize=10)
    if marks:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    return ax


def exp_range(dtypes, ax=None, x=(-30.0, 100.0), title="e^x against the largest finite value of each dtype"):
    """e^x (computed exactly, in float64) on a log axis, with each dtype's largest finite value as a
    horizontal line and the x beyond which e^x overflows to inf in that dtype marked below."""
    import torch

    ax = _axes(ax, (7, 4))
    xs = np.linspace(*x, 600)
    ax.semilogy(xs, np.exp(xs), color="black", lw=2, label="e^x")
    styles = ["-", "--", ":", "-."]
    colours = plt.get_cmap("tab10")(np.arange(len(dtypes)))
    for i, dtype in enumerate(dtypes):
        big = torch.finfo(dtype).max
        x_over = np.log(big)
        ax.axhline(big, color=colours[i], ls=styles[i % 4], lw=1.5,
                   label=f"{str(dtype).replace('torch.', '')} max {big:.3g}: e^x = inf for x > {x_over:.2f}")
        ax.axvline(x_over, color=colours[i], ls=styles[i % 4], lw=1, alpha=0.6)
    ax.axvspan(x[0], 0, color="#3a9e5f", alpha=0.12, label="x <= 0: e^x <= 1, safe in every dtype")
    ax.set_xlabel("x")
    ax.set_ylabel("e^x (log scale)")
    ax.set_xlim(*x)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return ax


# --- Chapters 05-07: the backward pass and testing ------------------------------------------------

def classify_blocks_dkdv(n_q, n_kv, block_q, block_kv, is_causal):
    """The dK/dV kernel's map of tiles, from :func:`flashattn.traversal.q_ranges`: an int array of
    shape (query blocks, key blocks) holding ``FULL``, ``MASKED`` or ``SKIPPED``.

    Each key block (a column) walks down the query blocks: the ones that cross the causal diagonal
    and a ragged last block are masked, the ones in between are full, those above are skipped.
    ``block_q`` must divide ``block_kv`` when ``is_causal`` (as the kernel requires)."""
    kinds = np.full((traversal.cdiv(n_q, block_q), traversal.cdiv(n_kv, block_kv)), traversal.SKIPPED,
                    dtype=np.int8)
    for kb in range(kinds.shape[1]):
        start, full_start, full_end, end = traversal.q_ranges(kb * block_kv, block_kv, block_q, n_q, is_causal)
        for lo, hi, kind in ((start, full_start, traversal.MASKED), (full_start, full_end, traversal.FULL),
                             (full_end, end, traversal.MASKED)):
            kinds[lo // block_q: traversal.cdiv(hi, block_q), kb] = kind
    return kinds


def backward_tile_maps(n_q, n_kv, is_causal, dkdv_blocks=(16, 32), dq_blocks=(32, 16), axes=None):
    """The tiles of the two backward stages side by side, for one (batch, head).

    Left, the dK/dV stage (blocks ``(BLOCK_Q, BLOCK_KV) = dkdv_blocks``): one program per key block
    (a column) walks DOWN it, over the query blocks of :func:`flashattn.traversal.q_ranges`.
    Right, the dQ stage (``dq_blocks``): one program per query block (a row) walks ALONG it, over
    the key blocks of :func:`flashattn.traversal.kv_ranges`. Colours: full, masked or skipped."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    arrow = dict(arrowstyle="->", color="#1f4e79", lw=1.2, alpha=0.8)
    what = f"N_q={n_q}, N_kv={n_kv}, {'causal' if is_causal else 'not causal'}"
    bq, bkv = dkdv_blocks
    kinds = classify_blocks_dkdv(n_q, n_kv, bq, bkv, is_causal)
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


def rule_ratios(labels, checks, ax=None, title="error / bound for each case (below 1 passes)"):
    """The tolerance rule over a sweep: for each case (one label and its list of
    :class:`flashattn.testing.Check`), the ratio error / bound of every quantity, on a log scale,
    with the pass line at 1."""
    ax = _axes(ax, (max(6, 0.55 * len(labels) + 2), 4))
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


# --- Chapters 03-04: tiles, causal blocks, the launch grid, and the forward kernel's pieces ------

def tile_kinds_map(kinds, n_q, n_kv, block_q, block_kv, is_causal=False, ax=None, title=None,
                   wrong=None, legend=True):
    """Draw any map of tile kinds (``FULL``, ``MASKED``, ``SKIPPED``, shape (query blocks, key
    blocks)), for instance one a learner computed, the way :func:`tile_map` draws the kernel's.
    ``wrong`` (a boolean array of the same shape) outlines those tiles in red."""
    ax = _axes(ax)
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
    ax = _axes(ax)
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
    ax = _axes(ax, (6, 4))
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
    ax = _axes(ax, (10, 0.5 + 0.7 * len(orders)))
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
    ax = _axes(ax, (8, 0.6 + 0.45 * n_workers))
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
    ax = _axes(ax, (0.45 * values.shape[1] + 1.2, 0.4 * values.shape[0] + 0.9))
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


# --- Chapter 08: performance (roofline, the ladder, per-configuration timings) ---------------------

def roofline(ceilings, points=(), ax=None, intensity=(1.0, 2e4), title="Roofline"):
    """Attainable TFLOPS against arithmetic intensity (FLOP per byte of HBM traffic), log-log.

    ``ceilings`` maps a label to ``(peak TFLOPS, bandwidth in TB/s)``; each draws its roof
    ``min(peak, intensity x bandwidth)`` (FLOP/byte x TB/s = TFLOP/s) and marks its ridge point,
    ``peak / bandwidth``. ``points`` is a list of dicts with ``x`` (FLOP/byte), ``y`` (TFLOPS),
    ``label`` and optional matplotlib keywords under ``style``; points sharing a label share one
    legend entry. Vertical lines can be added with dicts holding only ``x`` and ``label``."""
    ax = _axes(ax, (7.5, 4.8))
    xs = np.logspace(np.log10(intensity[0]), np.log10(intensity[1]), 400)
    for i, (label, (peak, bandwidth)) in enumerate(ceilings.items()):
        style = dict(color="black", ls="-" if i == 0 else "--", lw=1.8 if i == 0 else 1.3)
        ax.loglog(xs, np.minimum(peak, xs * bandwidth), label=f"{label}: ridge at {peak / bandwidth:.0f} FLOP/B",
                  **style)
        ax.plot([peak / bandwidth], [peak], "o", color="black", ms=4)
    seen = set()
    for p in points:
        style = dict(p.get("style", {}))
        if "y" not in p:  # a vertical marker (an intensity of interest)
            ax.axvline(p["x"], label=None if p["label"] in seen else p["label"], **style)
        else:
            style.setdefault("marker", "o")
            style.setdefault("ls", "none")
            ax.plot([p["x"]], [p["y"]], label=None if p["label"] in seen else p["label"], **style)
        seen.add(p["label"])
    ax.set_xlim(*intensity)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved to or from HBM)")
    ax.set_ylabel("TFLOPS (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="lower right", framealpha=0.95)
    return ax


def ladder_bars(steps, values, ax=None, title=None, xlabel="TFLOPS (log scale)", log=True):
    """Horizontal bars, one group per step (top to bottom in the order given) and one bar per
    series: ``values`` maps a series label (e.g. "forward") to one number per step. Each bar is
    labelled with its value."""
    series = list(values)
    ax = _axes(ax, (9, 0.55 * len(steps) * max(len(series), 1) + 1.2))
    height = 0.8 / len(series)
    y = np.arange(len(steps))
    for s, label in enumerate(series):
        pos = y + (s - (len(series) - 1) / 2) * height
        bars = ax.barh(pos, values[label], height=height * 0.95, label=label)
        for rect, v in zip(bars, values[label]):
            ax.text(rect.get_width() * (1.03 if log else 1.0) + (0 if log else 2), rect.get_y() + rect.get_height() / 2,
                    f"{v:.1f}", va="center", fontsize=7.5)
    ax.set_yticks(y, steps, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
        ax.set_xlim(right=ax.get_xlim()[1] * 2)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def config_bars(rows, ax=None, title=None, notes=None):
    """Measured time per tile configuration, fastest on top: ``rows`` are dicts (or CSV rows) with
    ``BLOCK_Q``, ``BLOCK_KV``, ``num_warps``, ``num_stages`` and ``ms``. The fastest is green; each
    other bar says how much slower it is; ``notes`` (a function of a row) may add text to its label."""
    rows = sorted(rows, key=lambda r: float(r["ms"]))
    ax = _axes(ax, (6, 0.4 * len(rows) + 1.2))
    best = float(rows[0]["ms"])
    labels, times = [], []
    for r in rows:
        bkv = f"x{r['BLOCK_KV']}" if str(r.get("BLOCK_KV", "")) not in ("", "None") else ""
        label = f"{r['BLOCK_Q']}{bkv}, {r['num_warps']} warps, {r['num_stages']} st."
        labels.append(label + (f"\n{notes(r)}" if notes else ""))
        times.append(float(r["ms"]))
    colors = ["#3a9e5f" if i == 0 else "#7fa7c9" for i in range(len(rows))]
    bars = ax.barh(range(len(rows)), times, color=colors)
    for rect, t in zip(bars, times):
        ax.text(rect.get_width(), rect.get_y() + rect.get_height() / 2,
                " fastest" if t == best else f" +{(t / best - 1) * 100:.0f}%", va="center", fontsize=7.5)
    ax.set_yticks(range(len(rows)), labels, fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlim(0, max(times) * 1.2)
    ax.set_xlabel("time (ms, median of do_bench); green: the fastest")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.25)
    return ax
