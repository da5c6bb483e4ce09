"""Pictures of a pipeline step: the schedule simulated above the step measured, one time axis.

Each row is a rank (labelled with the virtual stages it holds); each bar is one action: forward
F, input-gradient backward B (the whole backward when W is not split off), weight gradient W, each
in its own colour (chunk 1 and up hatched), with its micro-batch number when there is room; red is
time spent in a send or receive (waiting for a neighbour, posting a message, the end-of-step
collectives), grey the rest of the step (idle or Python between the actions). The legend sits
below the axes, so it covers nothing. The simulated row uses the measured mean F, B, W per stage.
"""
COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#C44E52", "idle": "#E3E3E3"}
LABELS = {"F": "F: forward", "B": "B: backward (input gradient if W is split off)", "W": "W: weight gradient",
          "wait": "send / recv wait", "idle": "idle / Python overhead"}


def simulated_bars(sim, p):
    """(row, kind, start, end, microbatch, chunk) for every action of a simulate result."""
    return [(s, a.kind, start, end, a.microbatch, a.chunk)
            for s in range(p) for a, start, end in sim["timeline"][s]]


def measured_bars(events, row_of_rank):
    """The same bars from one step's trace events (all ranks), times from the first stage's start
    of the step (row_of_rank: trace rank -> row; other ranks are left out)."""
    steps = [e for e in events if e["name"] == "pipeline step" and e["rank"] in row_of_rank]
    if not steps:
        return [], 0.0
    first = next((e for e in steps if row_of_rank[e["rank"]] == 0), steps[0])
    t0, t1 = first["start"], max(e["end"] for e in steps)
    bars = []
    for e in events:
        if e["rank"] not in row_of_rank or e["end"] <= t0 or e["start"] >= t1:
            continue                                      # (a wait begun before t0 is drawn from t0)
        args = e.get("args") or {}
        if "op" in args:
            kind = args["op"]
        elif e["kind"] == "comm" and e["name"] != "pipeline step":
            kind = "wait"
        else:
            continue
        bars.append((row_of_rank[e["rank"]], kind, max(e["start"], t0) - t0, min(e["end"], t1) - t0,
                     args.get("microbatch"), args.get("chunk", 0)))
    return bars, t1 - t0


def draw(ax, bars, rows, total, title, row_labels=None, unit=1e3):
    """Bars on one axis: a grey band per row for the whole step, then the actions on top."""
    for r in range(rows):
        ax.barh(r, total * unit, left=0, color=COLORS["idle"], height=0.8, lw=0)
    for row, kind, start, end, mb, chunk in sorted(bars, key=lambda b: b[1] != "wait"):
        height = 0.8 if kind != "wait" else 0.4
        ax.barh(row, (end - start) * unit, left=start * unit, color=COLORS[kind], height=height,
                edgecolor="k" if kind != "wait" else COLORS["wait"], lw=0.3, hatch="//" if chunk else None)
        if kind != "wait" and mb is not None and (end - start) > 0.025 * total:
            ax.text((start + end) / 2 * unit, row, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(rows), row_labels or [f"stage {r}" for r in range(rows)])
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_title(title, fontsize=9)


def plot_pipeline(schedule, sim, events, row_of_rank, path=None, title_sim=None, title_measured=None):
    """Two panels sharing the time axis (ms): sim (a simulate result, in seconds) above the
    measured step events; row_of_rank maps trace ranks to pipeline stages. Returns the figure."""
    import matplotlib
    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .schedules import virtual_stage
    p = len(schedule)
    held = [sorted({virtual_stage(a, s, p) for a in schedule[s]}) for s in range(p)]
    labels = [f"rank {s}: stage{'s' if len(h) > 1 else ''} {', '.join(map(str, h))}" for s, h in enumerate(held)]
    measured, measured_total = measured_bars(events, row_of_rank)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 1.6 + 0.7 * p * 2), sharex=True)
    draw(top, simulated_bars(sim, p), p, sim["total_time"], title_sim or "simulated", labels)
    draw(bottom, measured, p, measured_total, title_measured or "measured", labels)
    bottom.set_xlabel("time in the step (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    fig.legend(handles, [LABELS[k] for k in COLORS], loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
