"""The study's figures, one PNG each, small enough to commit (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path

from benchmark.report import pyplot, save_png

from .footprint import BatchLimit, KVBytesRow, UserMemory, pages_for_batches, pool_pages
from .onload import OnloadRow
from .visits import VisitRow

DPI = 90
MB = 2**20
plt = pyplot()


def _save(fig, path: Path) -> Path:
    return save_png(fig, path, dpi=DPI)


def _history_axis(ax, histories: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(histories, [str(h) for h in histories])
    ax.set_xlabel("history length (tokens)")
    ax.grid(alpha=0.3)


def history_share(visits: list[VisitRow], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [str(v.history) for v in visits]
    history = [100 * v.history_share for v in visits]
    ax.bar(labels, history, label="history (prefill)", color="tab:blue")
    ax.bar(labels, [100 - h for h in history], bottom=history, label="candidates", color="tab:orange")
    for i, h in enumerate(history):
        ax.text(i, h / 2, f"{h:.0f}%", ha="center", va="center", color="white", fontsize=8)
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("share of a full-recompute visit (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def latency(visits: list[VisitRow], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    histories = [v.history for v in visits]
    ax.plot(histories, [v.full_ms for v in visits], "o-", label="full recompute (history + candidates)")
    ax.plot(histories, [v.prefill_ms for v in visits], "s--", label="history alone (prefill)")
    ax.plot(histories, [v.cached_ms for v in visits], "^-", label="cached (new tokens + candidates)")
    ax.set_yscale("log")
    ax.set_ylabel("latency per visit (ms)")
    _history_axis(ax, histories)
    ax.legend(fontsize=8)
    return _save(fig, path)


def window_label(window: int) -> str:
    return f", window {window}" if window else ""


def kv_bytes(rows: list[KVBytesRow], limits: list[BatchLimit], batches: list[int], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for series in dict.fromkeys((r.preset, r.dtype, r.window) for r in rows):
        points = [r for r in rows if (r.preset, r.dtype, r.window) == series]
        left.plot([r.history for r in points], [r.kv_bytes / MB for r in points], "o-" if not series[2] else "s--",
                  label=" ".join(series[:2]) + window_label(series[2]))
    left.set_yscale("log")
    left.set_ylabel("K/V per user (MiB)")
    _history_axis(left, sorted({r.history for r in rows}))
    left.legend(fontsize=7)
    for limit in limits:
        if limit.window and limit.history <= limit.window:
            continue  # the window holds the whole history: the same line as without it
        (line,) = right.plot(batches, pages_for_batches(limit, batches), "o-" if not limit.window else "s--", ms=3,
                             label=f"history {limit.history}{window_label(limit.window)}")
        right.plot(batches, [pool_pages(limit, b) for b in batches], ":", color=line.get_color(), lw=1)
        if limit.max_batch_cached <= max(batches):
            right.plot([limit.max_batch_cached], [limit.max_batch_cached * limit.pages_per_user], "kx", ms=8)
    right.plot([], [], "k:", lw=1, label="pages that fit beside the batch's work")
    right.plot([], [], "kx", label="largest batch")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size (users)")
    right.set_ylabel("device pages")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return _save(fig, path)


def onload(rows: list[OnloadRow], path: Path) -> Path:
    tiers = list(dict.fromkeys(r.tier for r in rows))
    fig, axes = plt.subplots(1, len(tiers), figsize=(3.6 * len(tiers), 3.6), sharey=True, squeeze=False)
    for ax, tier in zip(axes[0], tiers):
        for codec in dict.fromkeys(r.codec for r in rows):
            points = [r for r in rows if r.tier == tier and r.codec == codec]
            ax.plot([r.history for r in points], [r.speedup for r in points], "o-", ms=3, label=codec)
        visits = [r for r in rows if r.tier == tier and r.codec == rows[0].codec]
        ax.plot([r.history for r in visits], [r.visit_speedup for r in visits], "k--", lw=1,
                label=f"whole visit ({rows[0].codec})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(tier)
        _history_axis(ax, sorted({r.history for r in rows}))
    axes[0][0].set_ylabel("recompute / reload (> 1: reload pays)")
    fig.suptitle("history: recompute / reload per codec; dashed: full visit / (reload + cached visit)", fontsize=9)
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def memory(users: list[UserMemory], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    histories = [u.history for u in users]
    ax.plot(histories, [u.without_cache / MB for u in users], "o-", label="without cache: a full visit's peak")
    ax.plot(histories, [u.with_cache_device / MB for u in users], "^-", label="with cache: pages + a cached visit's peak")
    ax.plot(histories, [u.with_cache_resident / MB for u in users], "s--", label="with cache, between visits: pages")
    ax.set_yscale("log")
    ax.set_ylabel("memory per served user (MiB)")
    _history_axis(ax, histories)
    ax.legend(fontsize=8)
    return _save(fig, path)
