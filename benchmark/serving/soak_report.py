"""The soak's figures: latency per time window, each process's memory growth, the PNG (benchmark/serving/soak.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmark.report import pyplot, save_png


def latency_windows(answered: list[dict], duration_s: float, window_s: float) -> list[dict]:
    """p50 and p99 of the answered requests sent in each `window_s` of the run."""
    windows = []
    for lo in np.arange(0.0, duration_s, window_s):
        lat = [r["latency_s"] * 1000 for r in answered if lo <= r["t"] < lo + window_s]
        if lat:
            windows.append({"t": float(lo), "count": len(lat), "p50_ms": float(np.percentile(lat, 50)),
                            "p99_ms": float(np.percentile(lat, 99))})
    return windows


def rss_growth(rss: dict[str, list[tuple]], warmup_s: float) -> dict[str, dict]:
    """Per process, the RSS growth of the incarnation alive at the end, from `warmup_s` after its (re)start.
    `rss[name]` holds (t, pid, MB, MB of it that is cache) samples."""
    growth = {}
    for name, series in rss.items():
        last_pid = series[-1][1]
        born = next(t for t, pid, *_ in series if pid == last_pid)
        mine = [(mb, cache) for t, pid, mb, cache in series if pid == last_pid and t >= born + warmup_s]
        if len(mine) >= 2:
            (first, first_cache), (last, last_cache) = mine[0], mine[-1]
            growth[name] = {"from_mb": first, "to_mb": last, "growth": last / first - 1,
                            "cache_from_mb": first_cache, "cache_to_mb": last_cache,
                            "growth_net_of_cache": (last - last_cache) / (first - first_cache) - 1}
    return growth


def plot(summary: dict, path: Path) -> None:
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(10, 7), sharex=True)
    w = summary["windows"]
    top.plot([x["t"] for x in w], [x["p99_ms"] for x in w], label="p99")
    top.plot([x["t"] for x in w], [x["p50_ms"] for x in w], label="p50")
    top.set_ylabel("latency (ms)")
    for name, series in summary["rss"].items():
        line, = bottom.plot([s[0] for s in series], [s[2] for s in series], label=f"{name} RSS")
        if any(s[3] for s in series):
            bottom.plot([s[0] for s in series], [s[2] - s[3] for s in series], color=line.get_color(),
                        linestyle=":", label=f"{name} RSS less cache")
    bottom.set_ylabel("MB")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        for event in summary["events"]:
            ax.axvline(event["t"], color="red" if event["event"].startswith("kill") else "green", alpha=0.4)
        ax.legend(fontsize=7)
    top.set_title(f"soak: {summary['requests']} requests, {summary['lost']} lost, {summary['wrong_logits']} wrong")
    save_png(fig, path, dpi=90)
