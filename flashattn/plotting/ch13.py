"""Pictures of chapter 13: the ring's schedule (which K/V block each rank holds at each step, and
which blocks of the attention matrix it computes then, the causal mask's skipped ones blank), the
tiles each rank computes in the two layouts, a step's transfer against its compute, and the memory
per GPU against the sequence length."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..distributed.layout import chunks_per_rank, rank_chunks
from ..distributed.schedule import ring_blocks, source_rank
from .common import axes_for

RANK_CMAP = "tab10"


def computed_blocks(world, layout="zigzag", is_causal=True):
    """Every block of the whole attention matrix the ring computes, as a list of
    ``(rank, step, query chunk, key chunk, diagonal)``, in ``2 * world`` chunks of positions
    whatever the layout (a contiguous rank's one chunk is two of them), ``diagonal`` where the
    causal mask applies inside the block."""
    split = 2 // chunks_per_rank(layout)  # the layout's chunk, in chunks of N / (2 world)
    found = []
    for rank in range(world):
        mine = rank_chunks(rank, world, layout)
        for step in range(world):
            source = source_rank(rank, step, world)
            theirs = rank_chunks(source, world, layout)
            for block in ring_blocks(rank, source, world, layout, is_causal):
                for i in range(*block.q):
                    for j in range(*block.kv):
                        for a in range(split):
                            for b in range(split):
                                qc, kc = mine[i] * split + a, theirs[j] * split + b
                                if block.causal and kc > qc:
                                    continue  # above the diagonal of a causal call: masked away
                                found.append((rank, step, qc, kc, block.causal and kc == qc))
    return found


def ring_holdings(world, ax=None, title=None):
    """The ring as a table: row = rank, column = step, each cell the K/V shard the rank holds then
    (the rank it started on), coloured by it. Each step every rank passes its shard to the next."""
    ax = axes_for(ax, (1.0 * world + 1.6, 0.55 * world + 1.2))
    cmap = plt.get_cmap(RANK_CMAP)
    for rank in range(world):
        for step in range(world):
            source = source_rank(rank, step, world)
            ax.add_patch(Rectangle((step, rank), 0.94, 0.9, color=cmap(source % 10), alpha=0.75, lw=0))
            ax.text(step + 0.47, rank + 0.45, f"K/V {source}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, world)
    ax.set_ylim(world, 0)
    ax.set_xticks(np.arange(world) + 0.47, [f"step {t}" for t in range(world)], fontsize=8)
    ax.set_yticks(np.arange(world) + 0.45, [f"rank {r}" for r in range(world)], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title or f"which K/V shard each rank holds\n(rank r passes its shard to rank r+1 after each step)",
                 fontsize=9)
    return ax


def ring_schedule(world, layout="zigzag", is_causal=True, ax=None, title=None):
    """The whole attention matrix (queries down, keys across), cut into ``2 * world`` chunks of
    positions for either layout: each block the ring computes is coloured by the rank that
    computes it and labelled with the step at which it does; the causal diagonal's blocks are
    hatched (the mask applies inside them) and the blocks the mask hides are left blank. Rows are
    in order of position, so a rank's two zigzag chunks are two bands far apart."""
    n_chunks = 2 * world
    ax = axes_for(ax, (4.2, 4.2))
    cmap = plt.get_cmap(RANK_CMAP)
    size = 1.0 / n_chunks
    for i in range(n_chunks):
        for j in range(n_chunks):
            ax.add_patch(Rectangle((j * size, i * size), size, size, fill=False, ec="#d0d0d0", lw=0.5))
    busiest = {}
    for rank, step, qc, kc, diagonal in computed_blocks(world, layout, is_causal):
        ax.add_patch(Rectangle((kc * size, qc * size), size, size, color=cmap(rank % 10), alpha=0.8, lw=0,
                               hatch="///" if diagonal else None))
        ax.text((kc + 0.5) * size, (qc + 0.5) * size, str(step), ha="center", va="center",
                fontsize=max(5, 11 - n_chunks // 2), color="black")
        busiest[rank] = busiest.get(rank, 0) + (0.5 if diagonal else 1.0)
    ax.set_xlim(0, 1)
    ax.set_ylim(1, 0)
    ax.set_aspect("equal")
    ticks = (np.arange(n_chunks) + 0.5) * size
    ax.set_xticks(ticks, [str(c) for c in range(n_chunks)], fontsize=7)
    ax.set_yticks(ticks, [str(c) for c in range(n_chunks)], fontsize=7)
    ax.set_xlabel("key chunk", fontsize=8)
    ax.set_ylabel("query chunk", fontsize=8)
    work = ", ".join(f"{busiest.get(r, 0):g}" for r in range(world))
    ax.set_title(title or f"{layout}, {'causal' if is_causal else 'no mask'}, {world} ranks\n"
                          f"blocks per rank (a hatched one counts 1/2): {work}", fontsize=9)
    handles = [Patch(color=cmap(r % 10), alpha=0.8, label=f"rank {r}") for r in range(world)]
    ax.legend(handles=handles, fontsize=7, loc="upper right", bbox_to_anchor=(1.32, 1.0), frameon=False)
    return ax


def rank_tile_bars(counts, ax=None, title=None):
    """Bars of the tiles each rank computes, one group per rank and one bar per layout:
    ``counts`` maps a layout's name to its list of counts, rank by rank. The dashed line of each
    layout is its busiest rank, which sets the ring's time."""
    names = list(counts)
    world = len(next(iter(counts.values())))
    ax = axes_for(ax, (1.0 * world + 2.5, 3.2))
    width = 0.8 / len(names)
    colors = ["#c0392b", "#2e86c1", "#7d3c98", "#229954"]
    for i, name in enumerate(names):
        xs = np.arange(world) + (i - (len(names) - 1) / 2) * width
        ax.bar(xs, counts[name], width * 0.95, color=colors[i % 4], label=name)
        ax.axhline(max(counts[name]), color=colors[i % 4], ls="--", lw=1)
    ax.set_xticks(np.arange(world), [f"rank {r}" for r in range(world)], fontsize=8)
    ax.set_ylabel("tiles computed", fontsize=8)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title or "tiles each rank computes (dashed: the busiest rank, which the ring waits for)",
                 fontsize=9)
    return ax


def overlap_timeline(compute_ms, transfer_ms, steps, ax=None, title=None):
    """Two timelines of a ring of ``steps`` steps where each block computes in ``compute_ms`` and
    each transfer takes ``transfer_ms``: one after the other (above), and with each step's transfer
    posted before its compute (below). Returns the Axes; the total times are in the labels."""
    ax = axes_for(ax, (9, 2.4))
    serial, overlapped = 0.0, 0.0
    for step in range(steps):
        ax.add_patch(Rectangle((serial, 1.1), compute_ms, 0.35, fc="#2e86c1", ec="white", lw=1))
        serial += compute_ms
        if step + 1 < steps:
            ax.add_patch(Rectangle((serial, 1.1), transfer_ms, 0.35, color="#e67e22"))
            serial += transfer_ms
        ax.add_patch(Rectangle((overlapped, 0.1), compute_ms, 0.35, fc="#2e86c1", ec="white", lw=1))
        if step + 1 < steps:
            ax.add_patch(Rectangle((overlapped, 0.5), transfer_ms, 0.25, color="#e67e22"))
            overlapped += max(compute_ms, transfer_ms)
        else:
            overlapped += compute_ms
    ax.set_xlim(0, max(serial, overlapped) * 1.02)
    ax.set_ylim(0, 2.0)
    ax.set_yticks([0.35, 1.27], [f"overlapped: {overlapped:.2f} ms", f"one after the other: {serial:.2f} ms"],
                  fontsize=8)
    ax.set_xlabel("ms", fontsize=8)
    ax.legend(handles=[Patch(color="#2e86c1", label="a block's kernels"),
                       Patch(color="#e67e22", label="the next K/V shard's transfer")],
              fontsize=8, frameon=False, loc="upper right", ncol=2)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def memory_per_gpu(seq_lens, bytes_per_token, worlds, capacity=None, ax=None, title=None):
    """GB per GPU against the sequence length when ``bytes_per_token`` bytes of each token live on
    the GPU that holds it, for each world size in ``worlds`` (log-log), with the GPU's ``capacity``
    in GB as a line."""
    ax = axes_for(ax, (6, 3.6))
    seq_lens = np.asarray(seq_lens, dtype=float)
    for world in worlds:
        ax.plot(seq_lens, seq_lens * bytes_per_token / world / 1e9, marker="o", ms=3,
                label=f"{world} GPU" + ("s" if world > 1 else ""))
    if capacity is not None:
        ax.axhline(capacity, color="black", ls="--", lw=1, label=f"one GPU's memory, {capacity:g} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (tokens)", fontsize=8)
    ax.set_ylabel("GB per GPU", fontsize=8)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(True, which="major", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
