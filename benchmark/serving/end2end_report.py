"""The replay's figure (latency against history length) and its table on stdout (benchmark/serving/end2end.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmark.report import pyplot, save_png
from model.replay import ReplayPass


def plot(passes: list[ReplayPass], path: Path, batch_size: int) -> None:
    """Batch latency against the batch's history length (per request when batch_size is 1)."""
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for p, color in zip(passes, ("tab:blue", "tab:red")):
        ax.scatter(p.batch_history_lengths, p.batch_latency_ms, s=6, alpha=0.5, color=color,
                   label=f"{p.name} (p50 {np.median(p.batch_latency_ms):.1f} ms per batch)")
    unit = "visit" if batch_size == 1 else f"batch of up to {batch_size} visits"
    ax.set_xlabel(f"history length (events, summed over the {unit})")
    ax.set_ylabel(f"latency per {unit} (ms)")
    ax.set_yscale("log")
    ax.set_title("Serving latency vs history length: KV cache vs full recompute")
    ax.legend()
    ax.grid(alpha=0.3)
    save_png(fig, path, dpi=120)


def print_summary(report: dict, passes: list[ReplayPass], task_names: tuple[str, ...]) -> None:
    rows = [("", *[p.name for p in passes])]
    rows.append(("requests", *[str(p.num_requests) for p in passes]))
    rows.append(("total time (s)", *[f"{p.seconds:.2f}" for p in passes]))
    rows.append(("throughput (req/s)", *[f"{p.num_requests / p.seconds:.1f}" for p in passes]))
    for q in ("p50", "p90", "p99"):
        rows.append((f"latency {q} (ms)", *[f"{report['latency_ms'][p.name][q]:.1f}" for p in passes]))
    rows.append(("tokens computed", *[f"{p.tokens_computed:,}" for p in passes]))
    rows.append(("tokens reused", *[f"{p.tokens_reused:,}" for p in passes]))
    costs = report.get("serving_cost") or {}
    if all(costs.get(p.name) for p in passes):
        rows.append(("aten ops per batch", *[f"{costs[p.name]['ops_per_batch']:,.0f}" for p in passes]))
        rows.append(("kernel ops per batch", *[f"{costs[p.name]['kernel_ops_per_batch']:,.0f}" for p in passes]))
        rows.append(("host syncs per batch", *[f"{costs[p.name]['sync_ops_per_batch']:.0f}" for p in passes]))
        if all(costs[p.name]["gpu_busy"] is not None for p in passes):
            rows.append(("GPU busy", *[f"{costs[p.name]['gpu_busy']:.0%}" for p in passes]))
    for task in task_names:
        rows.append((f"AUC {task}", *[_fmt_auc(report["auc"][p.name][task]) for p in passes]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
    if "speedup" in report:
        print(f"\nspeedup (full / cached): {report['speedup']:.2f}x   max |logit diff|: "
              f"{report['max_abs_logit_diff']:.3g} (scale {report['logit_scale']:.3g}, tolerance "
              f"{report['tolerance']:g}) -> parity {report['parity']}")
    c = report["cache"]
    print("cache: " + ", ".join(f"{k}={v}" for k, v in c.items()))


def _fmt_auc(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
