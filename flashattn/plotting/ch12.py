"""Pictures of chapter 12: the Gluon forward against the Triton forward and SDPA's default, and its
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


# ---------------------------------------------------------------------------- the forward's pipeline


def pipeline_schedule(n_tiles, stages, consumers=2, pingpong=True, mm_clocks=512.0, softmax_clocks=512.0,
                      load_clocks=512.0):
    """When each partition of the Gluon forward (``flashattn.hopper.forward``) does what, for one
    program streaming ``n_tiles`` K/V tiles through a ring of ``stages`` buffers: a small event
    simulation that follows the kernel's own order of operations and its mbarrier waits.

    The producer copies Q (one tile per consumer), then K_0, then K_j with V_{j-1}, then V_{n-1},
    each into slot ``j % stages`` once every consumer has released the tile that held it; the copy
    engine does one copy at a time (``load_clocks`` each, Q tiles ``load_clocks / 2``). Consumer c,
    in step j, waits for K_j and V_{j-1} (and, with ``pingpong``, for its turn), issues S_j = Q K_j^T
    and P_{j-1} V_{j-1} to the tensor cores (shared by the consumers, one matmul at a time,
    ``mm_clocks`` each), waits for S_j, releases K_j, computes the softmax of tile j
    (``softmax_clocks``, on its own warps), waits for P V and releases V_{j-1}.

    Returns a dict: ``boxes``, a list of (lane, start, end, label, kind) with lanes "copy engine",
    "tensor cores", "consumer c"; ``stalls``, a list of (lane, start, end, what) for every wait on
    an mbarrier that was not yet complete ("ready" for a tile not landed, "empty" for a slot not
    released, "turn" for ping-pong); and ``end``, the clock at which the last consumer is done."""
    half = load_clocks / 2
    # the producer's copies, in its order: (kind, tile, consumer for Q)
    copies = [("Q", c, c) for c in range(consumers)] + [("K", 0, None)]
    for j in range(1, n_tiles):
        copies += [("K", j, None), ("V", j - 1, None)]
    copies.append(("V", n_tiles - 1, None))
    landed, released = {}, {}           # (kind, tile) -> clock; (kind, tile, consumer) -> clock
    boxes, stalls = [], []
    state = dict(copy=0, producer=0.0, engine=0.0, tc=0.0)
    step = [0] * consumers              # the next step of each consumer (0 .. n_tiles)
    free = [0.0] * consumers            # when each consumer is ready for its next step
    issued = {}                         # (consumer, step) -> clock it issued its matmuls

    def producer_next():
        if state["copy"] == len(copies):
            return None
        kind, j, _ = copies[state["copy"]]
        if kind != "Q" and j >= stages:
            keys = [(kind, j - stages, c) for c in range(consumers)]
            if not all(k in released for k in keys):
                return None
            return max(state["producer"], max(released[k] for k in keys))
        return state["producer"]

    def producer_run(t):
        kind, j, c = copies[state["copy"]]
        if t > state["producer"]:
            stalls.append(("copy engine", state["producer"], t, "empty"))
        start = max(t, state["engine"])
        end = start + (half if kind == "Q" else load_clocks)
        label = f"Q{c}" if kind == "Q" else f"{kind}{j}"
        boxes.append(("copy engine", start, end, label, kind if kind == "Q" else f"slot {j % stages}"))
        landed[("Q", c) if kind == "Q" else (kind, j)] = end
        state.update(producer=t, engine=end, copy=state["copy"] + 1)

    def needs(c, s):
        need = [("Q", c)] if s == 0 else []
        if s < n_tiles:
            need.append(("K", s))
        if s >= 1:
            need.append(("V", s - 1))
        return need

    def turn_after(c, s):
        return (c - 1, s) if c > 0 else ((consumers - 1, s - 1) if s > 0 else None)

    def consumer_next(c):
        s = step[c]
        if s > n_tiles or not all(k in landed for k in needs(c, s)):
            return None
        t = max([free[c]] + [landed[k] for k in needs(c, s)])
        before = turn_after(c, s) if pingpong else None
        if before is not None:
            if before not in issued:
                return None
            t = max(t, issued[before])
        return t

    def consumer_run(c, t):
        s = step[c]
        lane = f"consumer {c}"
        data = max([free[c]] + [landed[k] for k in needs(c, s)])
        if data > free[c]:
            stalls.append((lane, free[c], data, "ready"))
        if t > data:
            stalls.append((lane, data, t, "turn"))
        issued[(c, s)] = t
        done = t
        if s < n_tiles:                                   # S_s = Q K_s^T
            start = max(t, state["tc"])
            s_end = start + mm_clocks
            state["tc"] = s_end
            boxes.append(("tensor cores", start, s_end, f"S{s}", f"consumer {c}"))
            released[("K", s, c)] = s_end
            boxes.append((lane, s_end, s_end + softmax_clocks, f"softmax {s}", "softmax"))
            done = s_end + softmax_clocks
        if s >= 1:                                        # O += P_{s-1} V_{s-1}
            start = max(t, state["tc"])
            pv_end = start + mm_clocks
            state["tc"] = pv_end
            boxes.append(("tensor cores", start, pv_end, f"PV{s - 1}", f"consumer {c}"))
            done = max(done, pv_end)
            released[("V", s - 1, c)] = done
        free[c], step[c] = done, s + 1

    while state["copy"] < len(copies) or any(s <= n_tiles for s in step):
        options = []
        t = producer_next()
        if t is not None:
            options.append((t, 0, -1))
        for c in range(consumers):
            t = consumer_next(c)
            if t is not None:
                options.append((t, 1, c))
        if not options:
            raise RuntimeError("the pipeline deadlocked")  # cannot happen with the kernel's order
        t, _, who = min(options)
        producer_run(t) if who < 0 else consumer_run(who, t)
    return dict(boxes=boxes, stalls=stalls, end=max(free))


def pipeline_timeline(schedule, ax=None, title=None):
    """Draw a :func:`pipeline_schedule`: one lane per partition (the copy engine the producer
    drives, the tensor cores, each consumer's own warps), a box per copy, matmul and softmax, the
    copies coloured by the ring's slot, the matmuls by consumer; hatched spans are waits on an
    mbarrier not yet complete (red: a tile not landed, or a slot not released; grey: ping-pong's
    turn)."""
    import matplotlib.pyplot as plt

    lanes = ["copy engine", "tensor cores"] + sorted({b[0] for b in schedule["boxes"] if b[0].startswith("consumer")})
    ax = axes_for(ax, (12, 0.8 + 0.7 * len(lanes)))
    kinds = sorted({b[4] for b in schedule["boxes"]})
    palette = dict(zip([k for k in kinds if k.startswith("slot")], plt.get_cmap("Pastel1").colors))
    palette.update(zip([k for k in kinds if k.startswith("consumer")], ["#9ecae1", "#fdae6b", "#a1d99b"]))
    palette.update(Q="#dddddd", softmax="#c7b9e0", dS="#e7d4e8", dQ="#fee391")
    for lane, start, end, label, kind in schedule["boxes"]:
        y = lanes.index(lane)
        ax.barh(y, end - start, left=start, height=0.6, color=palette.get(kind, "#cccccc"), edgecolor="black", lw=0.5)
        ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=6.5)
    for lane, start, end, what in schedule["stalls"]:
        y = lanes.index(lane)
        color = "#bbbbbb" if what in ("turn", "meet") else "#e34a33"
        ax.barh(y + 0.3, end - start, left=start, height=0.18, color="none", edgecolor=color, hatch="////", lw=0.8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("clock cycles of one SM (model)")
    ax.set_xlim(0, schedule["end"] * 1.01)
    names = [k for k in palette if k in kinds and (k.startswith(("slot", "consumer")) or k in ("softmax", "dS", "dQ"))]
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette[k]) for k in names]
    described = {"softmax": "exponentials", "dS": "dS = P (dP - Delta)", "dQ": "reduce-add of dQ"}
    names = [f"copy into {k}" if k.startswith("slot") else f"matmul of {k}" if k.startswith("consumer")
             else described[k] for k in names]
    handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor="#e34a33", hatch="////"))
    names.append("wait: tile not landed / slot not free")
    waits = {what for *_, what in schedule["stalls"]}
    for what, text in (("turn", "wait: ping-pong turn"), ("meet", "wait: the other consumer's dS")):
        if what in waits:
            handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor="#bbbbbb", hatch="////"))
            names.append(text)
    ax.legend(handles, names, fontsize=7, ncol=min(len(names), 5), loc="upper center", bbox_to_anchor=(0.5, -0.3))
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ---------------------------------------------------------------------------- the backward's pipeline


def backward_schedule(n_tiles, stages, fused=True, mm_clocks=256.0, exp_clocks=256.0, ds_clocks=64.0,
                      load_clocks=256.0, reduce_clocks=128.0):
    """When each partition of the Gluon backward (``flashattn.hopper.backward``) does what, for one
    program (a block of keys, two consumers) streaming ``n_tiles`` query tiles through a ring of
    ``stages`` buffers: the same kind of event simulation as :func:`pipeline_schedule`, following
    ``_bwd_consumer``'s order of operations and waits.

    The producer copies Q_j and dO_j (``load_clocks``) into slot ``j % stages`` once both consumers
    have released the tile that held it. Consumer c, in step j: waits for the tile; issues
    ``S^T = K Q^T`` and ``dP^T = V dO^T``; waits for S^T and computes P^T (``exp_clocks``, its
    exponentials); issues ``dV += P^T dO``; waits for dP^T and computes dS^T (``ds_clocks``); issues
    ``dK += dS^T Q``. With ``fused`` (the DQ variant) it then waits for the other consumer's dS^T
    (the two meet at an mbarrier), issues its half of ``dQ = dS K`` and, once that is done, hands
    the float32 result to the copy engine as a reduce-add (``reduce_clocks``). It releases the slot
    when its matmuls are done. The tensor cores do one matmul at a time (``mm_clocks`` each), in
    the order they were issued. Returns what :func:`pipeline_schedule` returns; stalls are "ready"
    (a tile not landed), "empty" (a slot not released) and "meet" (the other consumer's dS^T)."""
    consumers = 2
    boxes, stalls = [], []
    state = dict(copy=0, producer=0.0, engine=0.0, tc=0.0)
    landed, released, meet = {}, {}, {}
    step = [0] * consumers
    free = [0.0] * consumers     # when the consumer's warps can go on
    phase = [0] * consumers      # 0: wait for the tile, issue S^T and dP^T; 1: P^T, issue dV;
    ends = [dict() for _ in range(consumers)]  # 2: dS^T, issue dK; 3 (fused): meet, issue dQ

    def tc(t, label, c):
        start = max(t, state["tc"])
        state["tc"] = start + mm_clocks
        boxes.append(("tensor cores", start, start + mm_clocks, label, f"consumer {c}"))
        return start + mm_clocks

    def producer_next():
        j = state["copy"]
        if j == n_tiles:
            return None
        if j >= stages:
            keys = [(j - stages, c) for c in range(consumers)]
            if not all(k in released for k in keys):
                return None
            return max(state["producer"], max(released[k] for k in keys))
        return state["producer"]

    def producer_run(t):
        j = state["copy"]
        if t > state["producer"]:
            stalls.append(("copy engine", state["producer"], t, "empty"))
        start = max(t, state["engine"])
        end = start + load_clocks
        boxes.append(("copy engine", start, end, f"Q,dO {j}", f"slot {j % stages}"))
        landed[j] = end
        state.update(producer=t, engine=end, copy=j + 1)

    def consumer_next(c):
        j = step[c]
        if j == n_tiles:
            return None
        if phase[c] == 0:
            return None if j not in landed else max(free[c], landed[j])
        if phase[c] == 3:
            other = meet.get((j, 1 - c))
            return None if other is None else max(free[c], other)
        return free[c]

    def consumer_run(c, t):
        j, lane, e = step[c], f"consumer {c}", ends[c]
        if phase[c] == 0:                                 # S^T and dP^T, issued together
            if landed[j] > free[c]:
                stalls.append((lane, free[c], landed[j], "ready"))
            e["s"], e["dp"] = tc(t, f"S{j}", c), tc(t, f"dP{j}", c)
            free[c], phase[c] = e["s"] + exp_clocks, 1
            boxes.append((lane, e["s"], free[c], f"P {j}", "softmax"))
        elif phase[c] == 1:                               # dV += P^T dO
            e["dv"] = tc(t, f"dV{j}", c)
            start = max(t, e["dp"])
            free[c], phase[c] = start + ds_clocks, 2
            boxes.append((lane, start, free[c], f"dS {j}", "dS"))
        elif phase[c] == 2:                               # dK += dS^T Q; dS^T to shared memory
            e["dk"] = tc(t, f"dK{j}", c)
            done = max(e["dv"], e["dk"])
            if fused:
                meet[(j, c)] = t
                phase[c] = 3
            else:
                free[c] = released[(j, c)] = done
                phase[c], step[c] = 0, j + 1
        else:                                             # both halves of dS: dQ = dS K, reduce-add
            if t > free[c]:
                stalls.append((lane, free[c], t, "meet"))
            dq_end = tc(t, f"dQ{j}", c)
            start = max(dq_end, state["engine"])
            state["engine"] = start + reduce_clocks
            boxes.append(("copy engine", start, start + reduce_clocks, f"+dQ{j}", "dQ"))
            free[c] = released[(j, c)] = max(e["dv"], e["dk"], dq_end)
            phase[c], step[c] = 0, j + 1

    while state["copy"] < n_tiles or any(s < n_tiles for s in step):
        options = []
        t = producer_next()
        if t is not None:
            options.append((t, 0, -1))
        for c in range(consumers):
            t = consumer_next(c)
            if t is not None:
                options.append((t, 1, c))
        if not options:
            raise RuntimeError("the pipeline deadlocked")  # cannot happen with the kernel's order
        t, _, who = min(options)
        producer_run(t) if who < 0 else consumer_run(who, t)
    return dict(boxes=boxes, stalls=stalls, end=max(free))
