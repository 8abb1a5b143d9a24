"""Pictures of chapter 11: programs placed on the SMs of a GPU, the rows of a decode query tile
(grouped heads packed together), and the bandwidth a decoding step reaches."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from .common import axes_for


def place_programs(n_programs, n_sm):
    """Where ``n_programs`` equal programs run on ``n_sm`` SMs: program ``i`` on SM ``i % n_sm``,
    in wave ``i // n_sm`` (the first wave fills the SMs in launch order; with equal work every
    later program takes the SM that the program one wave earlier frees). A list of (SM, wave)."""
    return [(i % n_sm, i // n_sm) for i in range(n_programs)]


def sm_map(n_sm, owners, ax=None, cols=12, title=None, owner_name="sequence and KV head"):
    """The SMs of a GPU as a grid of squares, each holding the programs it runs, one bar per wave
    (:func:`place_programs`). ``owners`` has one entry per program in launch order, the index of
    what it works on (e.g. its (batch, KV head)); programs with the same owner share a colour, so
    the splits of one head show where they went. Idle SMs are left empty and counted in the
    title."""
    owners = list(owners)
    rows = -(-n_sm // cols)
    ax = axes_for(ax, (0.55 * cols + 1, 0.55 * rows + 1))
    placed = place_programs(len(owners), n_sm)
    waves = max((wave for _, wave in placed), default=-1) + 1
    cmap = plt.get_cmap("tab20")
    for sm in range(n_sm):
        x, y = sm % cols, sm // cols
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, fill=False, ec="#9e9e9e", lw=0.8))
    for owner, (sm, wave) in zip(owners, placed):
        x, y = sm % cols, sm // cols
        height = 0.84 / waves
        ax.add_patch(Rectangle((x + 0.1, y + 0.08 + wave * height), 0.8, height * 0.9,
                               color=cmap(owner % 20), lw=0))
    busy = len({sm for sm, _ in placed})
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.axis("off")
    summary = (f"{len(owners)} programs on {n_sm} SMs: {busy} busy, {n_sm - busy} idle"
               + (f", up to {waves} programs per SM" if waves > 1 else ""))
    ax.set_title(f"{title}\n{summary}" if title else summary, fontsize=9)
    ax.text(0, rows + 0.3, f"colour: the {owner_name} a program works on; one bar per program an SM runs",
            fontsize=7, va="top", color="#555555")
    return ax


def tile_rows(group, n_q, block_r, kv_head=0, ax=None, title=None):
    """The rows of the decode kernel's query tile for one KV head: row ``r`` holds new token
    ``r % n_q`` of query head ``kv_head * group + r // n_q``, as ``flashattn.decode`` packs them;
    rows past ``group * n_q`` are padding (masked). With more rows than ``block_r``, the tiles
    are drawn side by side. Every row is multiplied by the same tiles of K and V."""
    n_rows = group * n_q
    n_tiles = -(-n_rows // block_r)
    ax = axes_for(ax, (2.6 * n_tiles + 2.2, 0.28 * block_r + 1.2))
    cmap = plt.get_cmap("tab10")
    for tile in range(n_tiles):
        x = tile * 3.2
        for i in range(block_r):
            r = tile * block_r + i
            if r < n_rows:
                head, token = kv_head * group + r // n_q, r % n_q
                color, text = cmap(head % 10), f"q head {head}, token {token}"
            else:
                color, text = "#e0e0e0", "padding (masked)"
            ax.add_patch(Rectangle((x, i), 2.6, 0.92, color=color, alpha=0.85 if r < n_rows else 1.0, lw=0))
            ax.text(x + 0.08, i + 0.46, f"r={r:<3d} {text}", fontsize=7, va="center",
                    color="white" if r < n_rows else "#616161")
        ax.text(x + 1.3, -0.4, f"query tile {tile} (BLOCK_R = {block_r})", ha="center", fontsize=8)
    right = n_tiles * 3.2 - 0.6
    ax.annotate(f"x the same K and V tiles\nof KV head {kv_head}:\nread once for all\n{n_rows} rows",
                xy=(right, block_r / 2), xytext=(right + 0.3, block_r / 2), fontsize=8, va="center")
    ax.set_xlim(-0.1, right + 2.6)
    ax.set_ylim(block_r + 0.1, -0.9)
    ax.axis("off")
    ax.set_title(title or f"{group} query heads per KV head x {n_q} new token(s) = {n_rows} rows",
                 fontsize=10)
    return ax


def decode_bandwidth(rows, ax=None, title=None, providers=("decode", "sdpa-gqa", "attention-repeated")):
    """The cache read per second (TB/s) of a decoding step against the cache length, one bar per
    provider, and the measured copy bandwidth as a line. ``rows`` are rows of the decode
    benchmark's CSV (``python -m flashattn.measure.bench_decode``): ``provider``, ``cache_len``,
    ``cache_tbps`` and ``of_copy`` (the fraction of the copy bandwidth)."""
    ax = axes_for(ax, (7, 4))
    lengths = sorted({int(r["cache_len"]) for r in rows})
    shown = [p for p in providers if any(r["provider"] == p for r in rows)]
    width = 0.8 / max(len(shown), 1)
    for i, provider in enumerate(shown):
        values = [next((float(r["cache_tbps"]) for r in rows
                        if r["provider"] == provider and int(r["cache_len"]) == n), np.nan) for n in lengths]
        bars = ax.bar(np.arange(len(lengths)) + (i - (len(shown) - 1) / 2) * width, values, width * 0.95,
                      label=provider)
        for rect, v in zip(bars, values):
            if np.isfinite(v):
                ax.text(rect.get_x() + rect.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    copies = [float(r["cache_tbps"]) / float(r["of_copy"]) for r in rows if float(r["of_copy"]) > 0]
    top = max(float(r["cache_tbps"]) for r in rows)
    if copies:
        copy = float(np.median(copies))
        top = max(top, copy)
        ax.axhline(copy, color="black", ls="--", lw=1.2)
        ax.text(-0.45, copy * 0.98, f"copy bandwidth {copy:.2f} TB/s", va="top", ha="left", fontsize=8)
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("cache length N_kv (tokens)")
    ax.set_ylabel("K/V cache read per second (TB/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(handles=[Patch(color=f"C{i}", label=p) for i, p in enumerate(shown)], fontsize=8, loc="upper left",
              ncol=len(shown))
    return ax
