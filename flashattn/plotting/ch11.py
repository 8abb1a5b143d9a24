"""Pictures of chapter 11: the Gluon forward against the Triton forward and SDPA's default, and its
variants (ping-pong on and off)."""
import numpy as np

from .common import axes_for


def provider_bars(tflops, providers, ax=None, title=None, ylabel="TFLOPS"):
    """Grouped bars: ``tflops`` maps a setting label to ``{provider: TFLOPS}``; one group per
    setting, one bar per provider (in the order of ``providers``), the value written on top."""
    ax = axes_for(ax, (9, 3.8))
    settings = list(tflops)
    width = 0.8 / len(providers)
    x = np.arange(len(settings))
    for i, provider in enumerate(providers):
        values = [tflops[s].get(provider, np.nan) for s in settings]
        bars = ax.bar(x + (i - (len(providers) - 1) / 2) * width, values, width, label=provider)
        for bar, value in zip(bars, values):
            if np.isfinite(value):
                ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom",
                        fontsize=6.5, rotation=90)
    ax.set_xticks(x, settings, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.18 * max(v for row in tflops.values() for v in row.values()))
    ax.legend(fontsize=8, ncol=len(providers), loc="lower center")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.25)
    return ax
