#!/usr/bin/env python3
"""Plots the demo's results: engine KV-cache usage over time, without and with kvguard, on
one chart (and running / waiting requests below). With `kvguard-demo --prometheus` a strip
between them shows when each alert that fired went pending and firing, per run, and the
KV chart gets a line at each firing, and <out>-dashboard.png shows every panel of the shipped
Grafana dashboard drawn from Prometheus's answers over the run with kvguard (the range
queries the demo recorded; the picture of what Grafana would show). Writes <out>.png and
<out>.svg.

usage: plot_demo.py RESULTS_JSON OUT_BASENAME     (scripts/demo runs it with matplotlib
from a small virtualenv under $KVGUARD_CACHE)
"""

import json
import sys

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__.strip())
    sys.exit(0)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "kvguard-demo"  # stable SVG ids
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"leak": "#d62728", "kvguard": "#2ca02c"}
LABELS = {"leak": "without kvguard", "kvguard": "with kvguard"}


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        res = json.load(f)
    cfg = res["config"]
    runs = [(k, res[k]) for k in ("leak", "kvguard") if res.get(k)]
    if not runs:
        sys.exit("no runs in " + sys.argv[1])

    # Alerts that fired in a run (kvguard-demo --prometheus), with their first pending time.
    marks = {key: (r.get("observed") or {}).get("alerts", []) for key, r in runs}
    fired = sorted({m["name"] for ms in marks.values() for m in ms if m["state"] == "firing"})
    if fired:
        fig, (ax, ax_al, ax2) = plt.subplots(
            3, 1, figsize=(10, 7.5 + 0.25 * len(fired)), sharex=True,
            gridspec_kw={"height_ratios": [3, 0.5 + 0.35 * len(fired), 2]},
        )
    else:
        fig, (ax, ax2) = plt.subplots(
            2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
        )
    for key, r in runs:
        t = [s["t"] for s in r["series"]]
        kv = [100.0 * s["kv"] for s in r["series"]]
        label = f"{LABELS[key]}: orphan-seconds {r['orphan_seconds']:.0f}, KV at end {100 * r['kv_end']:.0f}%"
        ax.plot(t, kv, color=COLORS[key], lw=2, label=label)
        ax2.plot(t, [s["running"] for s in r["series"]], color=COLORS[key], lw=1.5,
                 label=f"running ({LABELS[key]})")
        ax2.plot(t, [s["waiting"] for s in r["series"]], color=COLORS[key], lw=1.5, ls="--",
                 label=f"waiting ({LABELS[key]})")
    if fired:
        # One row per alert that fired in either run: pending (hollow) to firing (filled),
        # red without kvguard, green with it (offset so both runs show); a line on the KV
        # chart at each firing.
        for key, _ in runs:
            dy = 0.15 if key == "leak" else -0.15
            for row, name in enumerate(fired):
                ms = {m["state"]: m["t"] for m in marks[key] if m["name"] == name}
                y = row + dy
                if "pending" in ms:
                    end = ms.get("firing", ms["pending"])
                    ax_al.plot([ms["pending"], end], [y, y], color=COLORS[key], lw=1, alpha=0.6)
                    ax_al.plot(ms["pending"], y, "o", mfc="none", color=COLORS[key], ms=5)
                if "firing" in ms:
                    ax_al.plot(ms["firing"], y, "o", color=COLORS[key], ms=6)
                    ax_al.text(ms["firing"], y, f"  {ms['firing']:.1f}s", color=COLORS[key],
                               fontsize=7, va="center")
                    ax.axvline(ms["firing"], color=COLORS[key], ls="-.", lw=1, alpha=0.7)
        ax_al.set_yticks(range(len(fired)))
        ax_al.set_yticklabels(fired, fontsize=8)
        ax_al.set_ylim(len(fired) - 0.5, -0.5)
        ax_al.set_title("alerts that fired (○ pending, ● firing; shipped rules, windows / 60)",
                        fontsize=8, loc="left")
        ax_al.grid(alpha=0.3)
        ax_al.axvline(cfg["arrival_s"], color="grey", ls=":", lw=1)
    for a in (ax, ax2):
        a.axvline(cfg["arrival_s"], color="grey", ls=":", lw=1)
        a.grid(alpha=0.3)
    ax.text(cfg["arrival_s"], 2, " arrivals stop", color="grey", fontsize=8, va="bottom")
    # Headroom above 100% for the legend, so it never hides the curves.
    ax.set_ylim(0, 128)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("engine KV-cache usage (%)")
    engine = "engine simulator" if cfg["engine"] == "sim" else "vLLM (CPU, tiny random Llama)"
    ax.set_title(
        f"KV-cache leak behind a hop that drops client disconnects — {engine}\n"
        f"{cfg['rate']:g} streams/s for {cfg['arrival_s']:g}s, "
        f"{100 * cfg['disconnect_share']:g}% disconnect, {100 * cfg['stall_share']:g}% stall, seed {cfg['seed']}",
        fontsize=10,
    )
    ax.legend(loc="upper center", fontsize=9, ncol=1, framealpha=0.9)
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds since the first arrival")
    top = max(max(s["running"], s["waiting"]) for _, r in runs for s in r["series"]) or 1
    ax2.set_ylim(0, top * 1.6)
    ax2.legend(loc="upper center", fontsize=7, ncol=2, framealpha=0.9)
    fig.tight_layout()
    base = sys.argv[2]
    fig.savefig(base + ".png", dpi=110)
    fig.savefig(base + ".svg", metadata={"Date": None})
    print(f"plot: {base}.png {base}.svg")
    plot_dashboard(res, base)


def plot_dashboard(res, base):
    """Every dashboard panel, as Prometheus answered its queries over the run with kvguard
    (else the one without): one small chart per panel, in the dashboard's order."""
    key = "kvguard" if (res.get("kvguard") or {}).get("observed") else "leak"
    obs = (res.get(key) or {}).get("observed") or {}
    dash = obs.get("dashboard") or []
    if not dash:
        return
    panels = {}
    for q in dash:
        panels.setdefault(q["query"]["panel"], []).append(q)
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(16, 2.3 * rows), squeeze=False)
    for ax, (title, queries) in zip(axes.flat, panels.items()):
        n = 0
        for q in queries:
            for labels, points in q["series"]:
                if not points:
                    continue
                t, v = zip(*points)
                # "__name__=..." would be taken for a hidden label (leading underscore).
                lab = labels.replace("__name__=", "") or q["query"]["expr"]
                ax.plot(t, v, lw=1, label=lab[:48])
                n += 1
        ax.set_title(title[:60], fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
        if n == 0:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    fontsize=8, color="grey")
        elif n <= 4:
            ax.legend(fontsize=5, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"envoy-config/grafana/kvguard-dashboard.json from Prometheus's answers "
                 f"({LABELS[key]}; x: seconds since Prometheus started)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(base + "-dashboard.png", dpi=90)
    print(f"dashboard: {base}-dashboard.png")


if __name__ == "__main__":
    main()
