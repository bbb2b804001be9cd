"""The cluster benchmark's figures: per-policy summary, the table, the PNG (benchmark/serving/cluster.py)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from benchmark.harness.loadgen import Sent, latency_summary
from benchmark.report import pyplot, save_png
from serve.locality_index import TIERS
from serve.metrics import histogram_quantile, parse_samples

PARITY_TOLERANCE = 1e-4  # relative to max(1, |logit|), as the end-to-end example


def summarize_repeats(runs: list[tuple[list[Sent], dict]], expected: dict, ideal: dict, rate: float) -> dict:
    """One policy over several replays: latency percentiles over all answers, token and byte counts
    per replay (averaged), and each replay's headline figures under `repeats` (their spread)."""
    if len(runs) == 1:
        sent, extra = runs[0]
        return summarize(sent, expected, ideal, extra, rate)
    each = [summarize(sent, expected, ideal, extra, rate) for sent, extra in runs]
    first = {k: v for k, v in runs[0][1].items() if k != "saturation"}
    out = summarize([s for sent, _ in runs for s in sent], expected, ideal, first, rate, repeats=len(runs))
    out["throughput_rps"] = float(np.mean([e["throughput_rps"] for e in each]))  # answer times are per replay
    keys = ("local_fraction", "reloaded_or_recomputed_tokens", "p50_ms", "p99_ms")
    out["repeats"] = [{k: e[k] for k in keys} | {"saturation_rps": e.get("saturation", {}).get("throughput_rps")}
                      for e in each]
    rates = [r["saturation_rps"] for r in out["repeats"] if r["saturation_rps"] is not None]
    if rates:
        out["saturation"] = {"throughput_rps": float(np.mean(rates)), "visits": sum(e["saturation"]["visits"] for e in each)}
    return out


def summarize(sent: list[Sent], expected: dict, ideal: dict, extra: dict, rate: float, fault: bool = False,
              repeats: int = 1) -> dict:
    """One policy's figures from its answers (see the benchmark's docstring for the definitions);
    token and byte counts are divided by `repeats` (answers pooled over that many replays)."""
    ok = [s for s in sent if s.ok]
    caches = [s.body["cache"] for s in ok]
    tiers = Counter(c["tier"] for c in caches)
    visits = max(len(ok), 1)
    reloaded = sum(c["tokens_reused"] for c in caches if c["tier"] == "shared")
    history = sum(c["tokens_computed"] - len(s.query.candidate_video_ids) for s, c in zip(ok, caches))
    extra_computed = history - sum(ideal[int(s.query.request_id)] for s in ok)
    diffs = [float(np.abs(np.asarray(s.body["logits"], dtype=np.float32) - expected[int(s.query.request_id)]).max())
             for s in ok]
    scale = max([1.0] + [float(np.abs(expected[int(s.query.request_id)]).max()) for s in ok])
    samples = parse_samples(extra.get("router_metrics", ""))
    out = {
        "visits": len(ok),
        "errors": len(sent) - len(ok),
        "error_examples": sorted({s.error or str(s.body) for s in sent if not s.ok})[:3],
        "offered_rate": rate,
        "tiers": {t: tiers.get(t, 0) for t in TIERS},
        "local_fraction": (tiers["device"] + tiers["host"]) / visits,
        "reloaded_tokens": reloaded // repeats,
        "shared_reload_bytes": sum(c["shared_reload_bytes"] for c in caches) // repeats,
        "recomputed_tokens": sum(c["tokens_recomputed"] for c in caches) // repeats,
        "extra_computed_tokens": extra_computed // repeats,
        "reloaded_or_recomputed_tokens": (reloaded + extra_computed) // repeats,
        "history_tokens_computed": history // repeats,
        "replays": repeats,
        "mean_batch_size": float(np.mean([s.body["batch_size"] for s in ok])) if ok else 0.0,
        **latency_summary(sent),
        "max_abs_logit_diff": max(diffs, default=0.0),
        "parity_ok": max(diffs, default=0.0) <= PARITY_TOLERANCE * scale,
        "router_failovers": sum(v for k, v in samples.items() if k.startswith("hstu_router_failovers_total")),
        "router_index_errors": samples.get("hstu_router_index_errors_total", 0.0),
        "router_internal_overhead_p50_ms": 1000.0 * histogram_quantile(0.5, samples, "hstu_router_overhead_seconds"),
    }
    if "saturation" in extra:
        out["saturation"] = extra["saturation"]
    if "router_overhead" in extra:
        out["router_overhead"] = extra["router_overhead"]
    if fault:
        out.update(fault_checks(sent, extra))
        out["passed"] = out["errors"] == 0 and out["parity_ok"] and out["victim_users_served_from_a_cache"]
    return out


def fault_checks(sent: list[Sent], extra: dict) -> dict:
    """Where the killed node's users went: their first visit after the kill."""
    victim, killed_after = extra["killed"], extra["killed_after_s"]
    home: dict[int, str] = {}
    for s in sorted((s for s in sent if s.ok and s.sent_s + s.latency_s < killed_after), key=lambda s: s.sent_s):
        home[s.query.user_id] = s.body["node"]
    moved = {u for u, node in home.items() if node == victim}
    first_after: dict[int, Sent] = {}
    for s in sorted((s for s in sent if s.sent_s >= killed_after and s.query.user_id in moved), key=lambda s: s.sent_s):
        first_after.setdefault(s.query.user_id, s)
    tiers = Counter(s.body["cache"]["tier"] if s.ok else "error" for s in first_after.values())
    return {
        "killed": victim,
        "killed_after_s": killed_after,
        "victim_users": len(moved),
        "victim_users_next_visit_tiers": dict(tiers),
        "victim_users_served_elsewhere": all(s.ok and s.body["node"] != victim for s in first_after.values()),
        "victim_users_served_from_a_cache": all(s.ok and s.body["node"] != victim and s.body["cache"]["tokens_reused"] > 0
                                                for s in first_after.values()),
        "max_latency_ms": max((s.latency_s * 1000.0 for s in sent), default=0.0),
    }


def table(report: dict) -> str:
    header = (f"{'policy':<12} {'local':>6} {'shared':>6} {'none':>5} {'reloaded':>9} {'extra':>8} {'reload+re':>9} "
              f"{'MiB':>7} {'p50 ms':>7} {'p99 ms':>8} {'visits/s':>8} {'max/s':>6} {'max diff':>9}")
    lines = [header]
    rows = list(report["policies"].items()) + ([("fault-run", report["fault"])] if "fault" in report else [])
    for name, p in rows:
        v = max(p["visits"], 1)
        lines.append(
            f"{name:<12} {p['local_fraction']:>6.1%} {p['tiers']['shared'] / v:>6.1%} {p['tiers']['none'] / v:>5.1%} "
            f"{p['reloaded_tokens']:>9,} {p['extra_computed_tokens']:>8,} {p['reloaded_or_recomputed_tokens']:>9,} "
            f"{p['shared_reload_bytes'] / 2**20:>7.1f} {p['p50_ms']:>7.1f} {p['p99_ms']:>8.1f} "
            f"{p['throughput_rps']:>8.2f} {p.get('saturation', {}).get('throughput_rps', float('nan')):>6.2f} "
            f"{p['max_abs_logit_diff']:>9.2e}"
        )
    for name, p in rows:
        if "repeats" in p:
            each = "; ".join(f"{r['p50_ms']:.0f}/{r['p99_ms']:.0f} ms, {r['reloaded_or_recomputed_tokens']:,} tokens"
                             for r in p["repeats"])
            lines.append(f"  {name} per replay (p50/p99, reloaded+recomputed): {each}")
    lines.append("local = cache on the serving node's device or host; reloaded = tokens reloaded from the shared tier; "
                 "extra = history tokens computed beyond a perfect cache; visits/s = answered at the offered rate; "
                 "max/s = closed-loop throughput at saturation")
    policies = report["policies"]
    if "kv-aware" in policies and "round-robin" in policies:
        kv, rr = policies["kv-aware"], policies["round-robin"]
        lines.append(f"round-robin / kv-aware: reloaded+recomputed tokens "
                     f"{rr['reloaded_or_recomputed_tokens'] / max(kv['reloaded_or_recomputed_tokens'], 1):.1f}x, "
                     f"p99 {rr['p99_ms'] / max(kv['p99_ms'], 1e-9):.2f}x, p50 {rr['p50_ms'] / max(kv['p50_ms'], 1e-9):.2f}x")
    overhead = policies.get("kv-aware", {}).get("router_overhead")
    if overhead:
        lines.append(f"router overhead (same requests, idle cluster, {overhead['requests_each']} each): p50 "
                     f"{overhead['p50_direct_ms']:.2f} ms direct vs {overhead['p50_router_ms']:.2f} ms routed: "
                     f"+{overhead['p50_overhead_ms']:.2f} ms ({overhead['ratio']:.3f}x), median of the paired "
                     f"differences +{overhead['median_paired_overhead_ms']:.2f} ms; outside the node's batcher and "
                     f"model {overhead['p50_outside_node_direct_ms']:.2f} vs {overhead['p50_outside_node_router_ms']:.2f} ms: "
                     f"+{overhead['p50_outside_node_overhead_ms']:.2f} ms; inside the router p50 "
                     f"{policies['kv-aware']['router_internal_overhead_p50_ms']:.2f} ms")
    if "fault" in report:
        f = report["fault"]
        lines.append(f"fault run: killed {f['killed']} after {f['killed_after_s']:.0f} s; {f['errors']} errors; its "
                     f"{f['victim_users']} users' next visits: {f['victim_users_next_visit_tiers']}; "
                     f"max latency {f['max_latency_ms']:.0f} ms; parity {'ok' if f['parity_ok'] else 'FAILED'} "
                     f"-> {'PASS' if f['passed'] else 'FAIL'}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    names = list(report["policies"])
    p = [report["policies"][n] for n in names]
    x = np.arange(len(names))
    fig, axes = pyplot().subplots(2, 2, figsize=(11, 8))
    bottom = np.zeros(len(names))
    for tier, color in zip(TIERS, ("tab:green", "tab:olive", "tab:orange", "tab:red")):
        share = np.array([q["tiers"][tier] / max(q["visits"], 1) for q in p])
        axes[0, 0].bar(x, share, bottom=bottom, color=color, label=tier)
        bottom += share
    axes[0, 0].set_title("where each visit's K/V came from")
    axes[0, 0].legend(fontsize=8)
    axes[0, 1].bar(x - 0.2, [q["reloaded_tokens"] for q in p], 0.4, label="reloaded from shared tier")
    axes[0, 1].bar(x + 0.2, [q["extra_computed_tokens"] for q in p], 0.4, label="computed beyond a perfect cache")
    axes[0, 1].set_title("tokens reloaded / recomputed")
    axes[0, 1].legend(fontsize=8)
    axes[1, 0].bar(x - 0.2, [q["p50_ms"] for q in p], 0.4, label="p50")
    axes[1, 0].bar(x + 0.2, [q["p99_ms"] for q in p], 0.4, label="p99")
    axes[1, 0].set_title(f"latency (ms) at {report['config']['rate']:g} visits/s offered")
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].bar(x - 0.2, [q["throughput_rps"] for q in p], 0.4, label="at the offered rate")
    axes[1, 1].bar(x + 0.2, [q.get("saturation", {}).get("throughput_rps", 0.0) for q in p], 0.4, label="saturated")
    axes[1, 1].set_title("throughput (visits/s answered; CPU-bound)")
    axes[1, 1].legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{report['config']['nodes']} nodes (1 torch thread each) on one CPU machine, "
                 f"{report['config']['visits']} visits")
    save_png(fig, path, dpi=110)
