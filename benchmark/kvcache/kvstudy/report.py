"""The study's Markdown report: one section a question, each a table of the figures and its plot."""
from __future__ import annotations

from dataclasses import dataclass

from .footprint import BatchLimit, KVBytesRow, UserMemory
from .onload import Crossovers, OnloadRow
from .visits import VisitRow

MB = 2**20
SECTIONS = (
    "## 1. Where a visit's time goes: the history against the candidates",
    "## 2. Cached against full recompute",
    "## 3. K/V bytes per user, device pages per batch, what limits the batch",
    "## 4. Onload from each tier and codec against recompute",
    "## 5. Memory per served user, with and without the cache",
)


@dataclass(frozen=True)
class StudyResult:
    setup: dict  # device, preset, dtype, threads, candidates, new tokens, repeats, command, wall time, notes
    visits: list[VisitRow]
    kv_bytes: list[KVBytesRow]
    limits: list[BatchLimit]
    onload: list[OnloadRow]
    crossovers: dict[str, Crossovers]  # "history", "visit"
    memory: list[UserMemory]
    figures: dict[str, str]  # section key -> PNG file name, beside the report


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MB:,.1f}" if nbytes >= 10 * MB else f"{nbytes / MB:.3g}"


def onload_table(rows: list[OnloadRow]) -> str:
    """One row a tier and codec, one column a history: reload ms and recompute / reload."""
    histories = sorted({r.history for r in rows})
    cells = {(r.tier, r.codec, r.history): f"{r.reload_ms:,.1f} ({r.speedup:,.1f}x)" for r in rows}
    keys = list(dict.fromkeys((r.tier, r.codec) for r in rows))
    recompute = {r.history: f"{r.recompute_ms:,.1f}" for r in rows}
    body = [["recompute (history alone)", "", *[recompute[h] for h in histories]]]
    body += [[tier, f"`{codec}`", *[cells[(tier, codec, h)] for h in histories]] for tier, codec in keys]
    return markdown_table(["tier", "codec", *[f"{h}: reload ms (recompute / reload)" for h in histories]], body)


def stored_table(rows: list[OnloadRow]) -> str:
    histories = sorted({r.history for r in rows})
    stored = {(r.codec, r.history): r.stored_bytes for r in rows if r.tier == rows[0].tier}
    codecs = list(dict.fromkeys(r.codec for r in rows))
    return markdown_table(["codec", *[f"{h} MiB" for h in histories]],
                          [[f"`{c}`", *[_mib(stored[(c, h)]) for h in histories]] for c in codecs])


def _figure(result: StudyResult, key: str) -> str:
    return f"![{key}]({result.figures[key]})" if key in result.figures else ""


def _crossover_text(crossovers: Crossovers, shortest: int) -> list[str]:
    lines = []
    for codec, tiers in crossovers.items():
        parts = []
        for tier, length in tiers.items():
            if length is None:
                parts.append(f"{tier}: recompute wins at the longest history")
            elif length == shortest:
                parts.append(f"{tier}: reload pays at every history tested")
            else:
                parts.append(f"{tier}: reload pays from {length} tokens on")
        lines.append(f"- `{codec}`: " + "; ".join(parts))
    return lines


def _onload_section(result: StudyResult) -> list[str]:
    rows = result.onload
    if not rows:
        return ["No tier was measured.", ""]
    histories = sorted({r.history for r in rows})
    first_codec = rows[0].codec
    visit = {(r.tier, r.history): r.visit_reload_ms for r in rows if r.codec == first_codec}
    full = {r.history: r.visit_full_ms for r in rows}
    tiers = list(dict.fromkeys(r.tier for r in rows))
    return [
        "Reload = `prepare_kv_cache` of a returning user whose K/V are in the tier only (read, decode, copy "
        "to fresh device pages) + rollback; recompute = the history alone (section 1). Ratio > 1: reloading pays. "
        "Only speed and bytes are measured here: what the lossy codecs cost in accuracy is "
        "`benchmark/kvcache/codec_report.py`'s to measure.",
        "",
        onload_table(rows),
        "",
        f"The whole visit of a returning user (ms): served from a tier (`{first_codec}`: reload + cached visit) "
        "or by full recompute:",
        "",
        markdown_table(["visit", *[str(h) for h in histories]],
                       [["full recompute", *[f"{full[h]:,.1f}" for h in histories]]]
                       + [[f"{t} reload + cached", *[f"{visit[(t, h)]:,.1f}" for h in histories]] for t in tiers]),
        "",
        "Bytes the tier stores per user, by codec (the memory tier's count; random K/V, so `zstd` finds "
        "little to compress where real K/V may give it more):",
        "",
        stored_table(rows),
        "",
        "Where reload stops paying: the shortest history from which it wins at every longer one, against "
        "recomputing the history alone,",
        "",
        *_crossover_text(result.crossovers["history"], histories[0]),
        "",
        "and for the whole visit (reload + cached visit against the full visit; at short histories a cached "
        "visit saves little, and the reload can cost more than it saves):",
        "",
        *_crossover_text(result.crossovers["visit"], histories[0]),
        "",
        _figure(result, "onload"),
        "",
    ]


def render(result: StudyResult) -> str:
    s, v = result.setup, result.visits
    out = [
        "# KV-reuse study",
        "",
        f"Produced by `{s['command']}` in **{s['wall_s']:.0f} s** on {s['device_name']}, torch threads: {s['threads']}.",
        f"Model: the `{s['preset']}` preset's shapes ({s['shape']}), {s['dtype']}, **untrained (random-initialised) "
        "weights**: latency and memory do not depend on the weights; embedding tables shrunk to "
        f"{s['video_rows']} rows (lookups are not what is studied). Every visit: batch 1, {s['candidates']} "
        f"candidates; a cached visit appends {s['new_tokens']} new history tokens (at most half the history). "
        f"Medians of {s['repeats']} "
        f"interleaved rounds after a round that measures memory and warms up; histories above "
        f"{s['long_history']}: {s['long_rounds']} timed rounds. Shares and speedups: medians of the per-round ratios.",
        "",
        *(f"> {note}" for note in s["notes"]),
        "",
        SECTIONS[0],
        "",
        "A full-recompute visit runs the whole history and the candidates; the history alone (prefill) is "
        "what the cache saves. Candidates' share = 1 - history share: their projections and their attention "
        "over the whole history.",
        "",
        markdown_table(["history", "full ms", "history alone ms", "history share", "candidates share"],
                       [[r.history, f"{r.full_ms:,.1f}", f"{r.prefill_ms:,.1f}", f"{r.history_share:.0%}",
                         f"{1 - r.history_share:.0%}"] for r in v]),
        "",
        _figure(result, "share"),
        "",
        SECTIONS[1],
        "",
        markdown_table(["history", "new tokens", "cached ms", "full ms", "speedup", "timed rounds"],
                       [[r.history, r.new_tokens, f"{r.cached_ms:,.1f}", f"{r.full_ms:,.1f}", f"{r.speedup:.2f}x", r.rounds]
                        for r in v]),
        "",
        _figure(result, "latency"),
        "",
        *_footprint_section(result),
        SECTIONS[3],
        "",
        *_onload_section(result),
        SECTIONS[4],
        "",
        "Without the cache a user costs memory only while its visit runs (the full visit's peak); with it, its "
        "pages stay resident between visits (on the device, or in a host tier once offloaded) and a visit adds "
        "the cached path's peak.",
        "",
        markdown_table(["history", "without cache MiB", "with cache, during a visit MiB", "with cache, between visits MiB"],
                       [[m.history, _mib(m.without_cache), _mib(m.with_cache_device), _mib(m.with_cache_resident)]
                        for m in result.memory]),
        "",
        _figure(result, "memory"),
        "",
    ]
    return "\n".join(out)


def _footprint_section(result: StudyResult) -> list[str]:
    """Section 3: K/V bytes per user, the device budget and the largest batch it serves."""
    s, v = result.setup, result.visits
    out = [
        SECTIONS[2],
        "",
        "K/V bytes per user (pages of K and V of every layer plus each token's int64 time), per preset and dtype, "
        "and for a model with a sliding attention window of W events, which holds only the pages its window still "
        "reads (kvcache/read_window.py; window 0: every key):",
        "",
    ]
    histories = sorted({r.history for r in result.kv_bytes})
    series = list(dict.fromkeys((r.preset, r.dtype, r.window) for r in result.kv_bytes))
    by_key = {(r.preset, r.dtype, r.window, r.history): r.kv_bytes for r in result.kv_bytes}
    out += [markdown_table(["preset dtype", "window", *[f"{h} MiB" for h in histories]],
                           [[" ".join(k[:2]), k[2], *[_mib(by_key[(*k, h)]) for h in histories]] for k in series]), ""]
    free = result.limits[0].free_bytes if result.limits else 0
    out += [
        f"Device budget {_mib(s['budget_bytes'])} MiB ({s['budget_source']}); weights of the preset with its real "
        f"embedding tables {_mib(s['weights_bytes'])} MiB; left for pages and working memory {_mib(free)} MiB. "
        "A batch's users hold their pages while it is served, and the cached visit needs its working memory: "
        f"a part per batch and a part per user, from its peaks at batch 1 and {v[0].memory_batch}:",
        "",
        markdown_table(["history", "window", "pages / user", "K/V MiB / user", "work MiB / user", "work MiB / batch",
                        "largest batch", "limited by"],
                       [[b.history, b.window, b.pages_per_user, _mib(b.kv_bytes_per_user), _mib(b.cached_work_per_user),
                         _mib(b.cached_work_per_batch), f"{b.max_batch_cached:,}", b.limited_by]
                        for b in result.limits]),
        "",
        _figure(result, "kv_bytes"),
        "",
    ]
    return out
