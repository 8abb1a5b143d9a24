"""Pictures of chapters 00-02: small matrices, where a tensor fits and what attention's memory
grows like (00), the online softmax's running state and partial outputs (01), the range of e^x in
each dtype (02)."""
import matplotlib.pyplot as plt
import numpy as np

from .common import axes_for, to_numpy


def matrix_panels(panels, fmt="{:.2f}", cmap="viridis", figsize_per=(3.0, 2.8), suptitle=None):
    """Small matrices side by side, each cell coloured and labelled with its value.

    ``panels`` maps a title to a 2-D tensor/array, or to ``(matrix, (row_label, col_label))``.
    Cells holding -inf (masked scores) are drawn grey and labelled "-inf"; the colour scale of each
    panel covers its finite values. Returns the figure."""
    fig, axes = plt.subplots(1, len(panels), figsize=(figsize_per[0] * len(panels), figsize_per[1]),
                             squeeze=False)
    for ax, (title, value) in zip(axes[0], panels.items()):
        matrix, (row_label, col_label) = value if isinstance(value, tuple) else (value, ("row", "column"))
        arr = np.atleast_2d(to_numpy(matrix))
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
    ax = axes_for(ax, (8, 0.6 * len(levels) + 1.8))
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


def memory_curve(seq_lens, series, ax=None, title="Memory for one (batch, head)"):
    """Bytes against sequence length on log-log axes; ``series`` maps a label to byte counts."""
    ax = axes_for(ax, (5.5, 4))
    for label, values in series.items():
        ax.loglog(seq_lens, values, marker="o", label=label)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("bytes")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def softmax_trace(x_row, block, ax=None):
    """How the online softmax of one row evolves block by block.

    Four panels (when ``ax`` is None or holds four axes): the row itself, shaded block by block,
    with each block's max and the running max M over it; then, after each block, the running max M,
    the running sum L and the correction factor alpha = exp(M_old - M_new) that rescaled everything
    accumulated before. The blocks where M rose (alpha < 1) are marked in red in every panel. Given
    three axes, the row panel is left out."""
    import torch

    from ..testing.reference import online_softmax_trace

    x = torch.as_tensor(x_row, dtype=torch.float64).reshape(-1)
    trace = online_softmax_trace(x, block)
    n, n_blocks = x.shape[0], trace["M"].shape[0]
    blocks = np.arange(1, n_blocks + 1)
    rose = to_numpy(trace["alpha"]) < 1
    if ax is None:
        _, ax = plt.subplots(1, 4, figsize=(15, 3.3), gridspec_kw=dict(width_ratios=[1.5, 1, 1, 1]))
    ax = list(np.ravel(ax))
    if len(ax) == 4:
        row_ax, ax = ax[0], ax[1:]
        xs = to_numpy(x)
        for b in range(n_blocks):
            lo, hi = b * block, min((b + 1) * block, n)
            row_ax.axvspan(lo - 0.5, hi - 0.5, color="#eef3f8" if b % 2 == 0 else "white", zorder=0)
            bmax, m = to_numpy(trace["block_max"][b]), to_numpy(trace["M"][b])
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
        values = to_numpy(trace[name])
        a.plot(blocks, values, marker="o", color="#1f4e79")
        a.plot(blocks[rose], values[rose], "o", color="#c0392b", label="M rose here" if name == "alpha" else None)
        a.set_xlabel("blocks seen")
        a.set_title(label, fontsize=10)
        a.set_xticks(blocks)
    ax[0].plot(blocks, to_numpy(trace["block_max"]), marker="x", ls=":", color="gray", label="max of the block")
    ax[0].legend(fontsize=8)
    ax[2].set_ylim(-0.05, 1.05)
    ax[2].legend(fontsize=8, loc="lower right")
    return ax


def partial_outputs(estimates, final, ax=None, title="O estimated from the blocks seen so far"):
    """How the output row converges as blocks stream in: ``estimates`` is (n_blocks, D), the
    normalised output acc / L after each block; ``final`` (D,) the exact output, drawn dashed."""
    ax = axes_for(ax, (6, 3.6))
    est, fin = to_numpy(estimates), to_numpy(final).reshape(-1)
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


def exp_range(dtypes, ax=None, x=(-30.0, 100.0), title="e^x against the largest finite value of each dtype"):
    """e^x (computed exactly, in float64) on a log axis, with each dtype's largest finite value as a
    horizontal line and the x beyond which e^x overflows to inf in that dtype marked below."""
    import torch

    ax = axes_for(ax, (7, 4))
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
