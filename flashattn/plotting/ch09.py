"""Pictures of chapter 09: the roofline, TFLOPS against sequence length, the ladder of
improvements, and timings per tile configuration."""
import numpy as np

from .common import axes_for


def roofline(ceilings, points=(), ax=None, intensity=(1.0, 2e4), title="Roofline"):
    """Attainable TFLOPS against arithmetic intensity (FLOP per byte of HBM traffic), log-log.

    ``ceilings`` maps a label to ``(peak TFLOPS, bandwidth in TB/s)``; each draws its roof
    ``min(peak, intensity x bandwidth)`` (FLOP/byte x TB/s = TFLOP/s) and marks its ridge point,
    ``peak / bandwidth``. ``points`` is a list of dicts with ``x`` (FLOP/byte), ``y`` (TFLOPS),
    ``label`` and optional matplotlib keywords under ``style``; points sharing a label share one
    legend entry. Vertical lines can be added with dicts holding only ``x`` and ``label``."""
    ax = axes_for(ax, (7.5, 4.8))
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


def tflops_curves(rows, ax=None, title=None):
    """TFLOPS against sequence length, one line per provider. ``rows`` are dicts (or CSV rows)
    with at least ``provider``, ``seq_len`` and ``tflops`` for one setting."""
    ax = axes_for(ax, (6, 4))
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


def ladder_bars(steps, values, ax=None, title=None, xlabel="TFLOPS (log scale)", log=True):
    """Horizontal bars, one group per step (top to bottom in the order given) and one bar per
    series: ``values`` maps a series label (e.g. "forward") to one number per step. Each bar is
    labelled with its value."""
    series = list(values)
    ax = axes_for(ax, (9, 0.55 * len(steps) * max(len(series), 1) + 1.2))
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
    ax = axes_for(ax, (6, 0.4 * len(rows) + 1.2))
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
