"""Animations of one program walking its tiles: the forward kernel's online softmax (chapter 05) and
the two loops of the backward pass, dK/dV walking query tiles and dQ walking key tiles (chapter 07).

Each function computes, in float64 and in the kernel's order, what one program holds after each
tile it visits, and returns a matplotlib ``FuncAnimation`` with one frame per tile: on the left the
tile map of S with the program's row (or column) of tiles, the tiles done and the tile now; on the
right the program's state. :func:`as_html` turns an animation into HTML and JavaScript that play in
Jupyter and in a static HTML page (``IPython.display.display(plotting.as_html(anim))``).

Keep the inputs tiny (tens of rows, a handful of tiles): every frame is a picture in the page.
"""
import math
import re

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.animation import FuncAnimation
from matplotlib.patches import Rectangle

from ..kernels import traversal
from .ch03_05 import TILE_COLORS
from .common import to_numpy

FRAME_MS = 900  # how long each frame stays, in milliseconds


#: The player's buttons as plain characters: matplotlib draws them with an icon font fetched from
#: a CDN, which leaves them blank offline (a laptop on a train, the HTML edition).
_BUTTONS = {"fa-minus": "\u2212", "fa-fast-backward": "\u23ee", "fa-step-backward": "\u23f4\u2759",
            "fa-play fa-flip-horizontal": "\u25c0", "fa-pause": "\u23f8", "fa-play": "\u25b6",
            "fa-step-forward": "\u2759\u23f5", "fa-fast-forward": "\u23ed", "fa-plus": "+"}


def as_html(animation):
    """The animation as an HTML snippet with its frames and player (``FuncAnimation.to_jshtml``),
    ready for ``IPython.display.display``; closes its figure, so that Jupyter does not also show the
    last frame as a still picture. It needs no network: the buttons are characters, not icons."""
    from IPython.display import HTML

    html = animation.to_jshtml(default_mode="once")
    plt.close(animation._fig)
    html = re.sub(r'<link[^>]*font-awesome[^>]*>', "", html)
    for icon, text in _BUTTONS.items():
        html = html.replace(f'<i class="fa {icon}"></i>', text)
    return HTML(html)


def _tiles_axes(ax, n_q, n_kv, block_q, block_kv, is_causal):
    """The tile map of S, light, as the background the walk is drawn on."""
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    for (qb, kb), kind in np.ndenumerate(kinds):
        x0, y0 = kb * block_kv, qb * block_q
        ax.add_patch(Rectangle((x0, y0), min(block_kv, n_kv - x0), min(block_q, n_q - y0),
                               facecolor=TILE_COLORS[int(kind)], alpha=0.35, edgecolor="white", lw=1.0))
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return kinds


def _mark(ax, tiles, now, n_q, n_kv, block_q, block_kv):
    """Outline the tiles done (thin) and the tile now (thick) of a walk; returns the patches."""
    patches = []
    for qb, kb in tiles:
        x0, y0 = kb * block_kv, qb * block_q
        current = (qb, kb) == now
        patches.append(ax.add_patch(Rectangle((x0, y0), min(block_kv, n_kv - x0), min(block_q, n_q - y0),
                                              fill=current, facecolor="none" if not current else "#1f77b4",
                                              alpha=1.0 if not current else 0.45, edgecolor="black",
                                              lw=2.5 if current else 1.0)))
    return patches


def _heat(ax, values, title, vmax, first_row=0):
    """A heatmap of a (rows, D) accumulator whose rows are sequence positions from ``first_row``."""
    ax.clear()
    rows, cols = values.shape
    ax.imshow(to_numpy(values), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto", interpolation="nearest",
              extent=(-0.5, cols - 0.5, first_row + rows - 0.5, first_row - 0.5))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("d")


def _figure(panels, width_ratios):
    fig, axes = plt.subplots(1, panels, figsize=(2.6 * panels, 2.9), dpi=64,
                             gridspec_kw=dict(width_ratios=width_ratios))
    return fig, axes


def forward_walk(q, k, v, block_q=16, block_kv=16, q_block=0, is_causal=False, scale=None):
    """One program of the forward kernel: query block ``q_block`` walks its key tiles (the full
    ones, then the masked ones; the skipped ones never). Frames show, after each tile, the running
    max M and sum L of each row (the previous values dotted), and the output so far, acc / L.

    ``q`` is (N_q, D), ``k`` and ``v`` (N_kv, D), any float dtype (computed in float64)."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    n_q, n_kv, d = q.shape[0], k.shape[0], q.shape[1]
    scale = d ** -0.5 if scale is None else scale
    rows = torch.arange(q_block * block_q, min((q_block + 1) * block_q, n_q))
    _, kv_end = traversal.kv_ranges(q_block * block_q, block_q, block_kv, n_kv, is_causal)
    m = torch.full((len(rows),), float("-inf"), dtype=torch.float64)
    l = torch.zeros(len(rows), dtype=torch.float64)
    acc = torch.zeros(len(rows), d, dtype=torch.float64)
    states = []
    for kv_start in range(0, kv_end, block_kv):
        cols = torch.arange(kv_start, min(kv_start + block_kv, n_kv))
        s = q[rows] @ k[cols].T * scale
        if is_causal:
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        l, acc = l * alpha + p.sum(-1), acc * alpha[:, None] + p @ v[cols]
        states.append((kv_start // block_kv, m.clone(), m_new.clone(), l.clone(), (acc / l[:, None]).clone()))
        m = m_new
    final = states[-1][4]
    vmax = float(final.abs().max()) * 1.1 or 1.0
    m_lo = float(min(s[2].min() for s in states)) - 0.3
    m_hi = float(max(s[2].max() for s in states)) + 0.3
    l_hi = float(max(s[3].max() for s in states)) * 1.1

    fig, (ax_tiles, ax_m, ax_l, ax_o) = _figure(4, [1.2, 1, 1, 1])
    _tiles_axes(ax_tiles, n_q, n_kv, block_q, block_kv, is_causal)
    marks = []

    def draw(frame):
        kb, m_old, m_now, l_now, o_now = states[frame]
        for patch in marks:
            patch.remove()
        marks[:] = _mark(ax_tiles, [(q_block, b) for b in range(kb + 1)], (q_block, kb), n_q, n_kv,
                         block_q, block_kv)
        ax_tiles.set_title(f"program {q_block}: tile {frame + 1} of {len(states)}", fontsize=9)
        y = rows.numpy()
        ax_m.clear()
        ax_m.plot(to_numpy(m_old), y, ":", color="grey", label="before")
        ax_m.plot(to_numpy(m_now), y, "o-", ms=3, color="C3", label="after")
        ax_m.set_xlim(m_lo, m_hi)
        ax_m.set_ylim(y[-1] + 0.5, y[0] - 0.5)
        ax_m.set_title("running max M per row", fontsize=9)
        ax_m.legend(fontsize=7, loc="lower right")
        ax_l.clear()
        ax_l.barh(y, to_numpy(l_now), color="C0")
        ax_l.set_xlim(0, l_hi)
        ax_l.set_ylim(y[-1] + 0.5, y[0] - 0.5)
        ax_l.set_title("running sum L per row", fontsize=9)
        _heat(ax_o, o_now, "acc / L: the output so far", vmax, first_row=int(rows[0]))
        return marks

    draw(0)
    fig.tight_layout()
    return FuncAnimation(fig, draw, frames=len(states), interval=FRAME_MS, repeat=False)


def _backward_state(q, k, v, do, is_causal, scale):
    """P, dP, dS of every (query, key) pair in float64 (the backward of chapter 06), for the walks."""
    s = q @ k.T * scale
    if is_causal:
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    dp = do @ v.T
    delta = (o * do).sum(-1)
    ds = p * (dp - delta[:, None])
    return p, ds


def _walk_panels(states, title_of, heat_titles, n_q, n_kv, block_q, block_kv, is_causal, finals, first_row):
    """An animation of a backward walk: the tile map, then one heatmap per accumulator, then how
    far each accumulator still is from its final value."""
    fig, axes = _figure(2 + len(heat_titles), [1.2] + [1] * len(heat_titles) + [1])
    ax_tiles, heat_axes, ax_err = axes[0], axes[1:-1], axes[-1]
    _tiles_axes(ax_tiles, n_q, n_kv, block_q, block_kv, is_causal)
    vmax = [float(f.abs().max()) * 1.1 or 1.0 for f in finals]
    errors = [[float((st[2][i] - finals[i]).norm() / finals[i].norm().clamp_min(1e-300)) for st in states]
              for i in range(len(finals))]
    marks = []

    def draw(frame):
        tiles, now, values = states[frame]
        for patch in marks:
            patch.remove()
        marks[:] = _mark(ax_tiles, tiles, now, n_q, n_kv, block_q, block_kv)
        ax_tiles.set_title(title_of(frame), fontsize=9)
        for ax, value, title, top in zip(heat_axes, values, heat_titles, vmax):
            _heat(ax, value, title, top, first_row)
        ax_err.clear()
        for series, title in zip(errors, heat_titles):
            ax_err.plot(range(1, frame + 2), series[:frame + 1], "o-", ms=3, label=title.split(" ")[0])
        ax_err.set_xlim(0.5, len(states) + 0.5)
        ax_err.set_ylim(0, 1.05 * max(max(e) for e in errors) or 1.0)
        ax_err.set_xlabel("tiles done")
        ax_err.set_title("distance to the final value", fontsize=9)
        ax_err.legend(fontsize=7)
        return marks

    draw(0)
    fig.tight_layout()
    return FuncAnimation(fig, draw, frames=len(states), interval=FRAME_MS, repeat=False)


def dkdv_walk(q, k, v, do, block_q=16, block_kv=16, kv_block=0, is_causal=False, scale=None):
    """One program of the dK/dV stage: key block ``kv_block`` stays on chip and walks the query
    tiles that see it (under the causal mask, from its diagonal down), adding P^T dO to dV and
    scale * dS^T Q to dK after each one. Frames show dV and dK so far and how far each still is
    from its final value.

    ``q``, ``do`` are (N_q, D), ``k``, ``v`` (N_kv, D), any float dtype (computed in float64)."""
    q, k, v, do = (t.detach().double().cpu() for t in (q, k, v, do))
    n_q, n_kv, d = q.shape[0], k.shape[0], q.shape[1]
    scale = d ** -0.5 if scale is None else scale
    p, ds = _backward_state(q, k, v, do, is_causal, scale)
    cols = slice(kv_block * block_kv, min((kv_block + 1) * block_kv, n_kv))
    kinds = traversal.classify_blocks(n_q, n_kv, block_q, block_kv, is_causal)
    visited = [qb for qb in range(kinds.shape[0]) if kinds[qb, kv_block] != traversal.SKIPPED]
    dk = torch.zeros(cols.stop - cols.start, d, dtype=torch.float64)
    dv = torch.zeros_like(dk)
    states = []
    for step, qb in enumerate(visited):
        rows = slice(qb * block_q, min((qb + 1) * block_q, n_q))
        dv = dv + p[rows, cols].T @ do[rows]
        dk = dk + scale * ds[rows, cols].T @ q[rows]
        states.append(([(b, kv_block) for b in visited[:step + 1]], (qb, kv_block), (dv.clone(), dk.clone())))
    return _walk_panels(states, lambda f: f"program {kv_block}: query tile {f + 1} of {len(states)}",
                        ["dV (keys x D)", "dK (keys x D)"], n_q, n_kv, block_q, block_kv, is_causal,
                        states[-1][2], first_row=cols.start)


def dq_walk(q, k, v, do, block_q=16, block_kv=16, q_block=0, is_causal=False, scale=None):
    """One program of the dQ stage: query block ``q_block`` stays on chip and walks its key tiles
    (as the forward does), adding scale * dS K to dQ after each one. Frames show dQ so far and how
    far it still is from its final value.

    ``q``, ``do`` are (N_q, D), ``k``, ``v`` (N_kv, D), any float dtype (computed in float64)."""
    q, k, v, do = (t.detach().double().cpu() for t in (q, k, v, do))
    n_q, n_kv, d = q.shape[0], k.shape[0], q.shape[1]
    scale = d ** -0.5 if scale is None else scale
    _, ds = _backward_state(q, k, v, do, is_causal, scale)
    rows = slice(q_block * block_q, min((q_block + 1) * block_q, n_q))
    _, kv_end = traversal.kv_ranges(q_block * block_q, block_q, block_kv, n_kv, is_causal)
    visited = list(range(math.ceil(kv_end / block_kv)))
    dq = torch.zeros(rows.stop - rows.start, d, dtype=torch.float64)
    states = []
    for step, kb in enumerate(visited):
        cols = slice(kb * block_kv, min((kb + 1) * block_kv, n_kv))
        dq = dq + scale * ds[rows, cols] @ k[cols]
        states.append(([(q_block, b) for b in visited[:step + 1]], (q_block, kb), (dq.clone(),)))
    return _walk_panels(states, lambda f: f"program {q_block}: key tile {f + 1} of {len(states)}",
                        ["dQ (queries x D)"], n_q, n_kv, block_q, block_kv, is_causal, states[-1][2],
                        first_row=rows.start)
