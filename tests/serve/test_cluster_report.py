"""The cluster benchmark's figures from hand-made answers: tiers, tokens vs a perfect cache, parity, the fault checks."""
from __future__ import annotations

import numpy as np

from benchmark.harness.loadgen import Sent
from benchmark.serving.cluster_report import plot, summarize, summarize_repeats, table
from serve.protocol import ScoreQuery


def answer(position, user, node, tier, reused, computed, sent_s, latency_s, logits, candidates=2, shared_bytes=0):
    query = ScoreQuery(user, 1_000 + position, tuple(range(candidates)), request_id=str(position))
    body = {"node": node, "logits": logits, "batch_size": 1, "queue_ms": 1.0, "compute_ms": 5.0,
            "cache": {"tier": tier, "tokens_reused": reused, "tokens_computed": computed, "tokens_recomputed": 0,
                      "shared_reload_bytes": shared_bytes}}
    return Sent(position, query, 200, body, sent_s, latency_s)


EXPECTED = {i: np.full((2, 8), 0.5, dtype=np.float32) for i in range(4)}
IDEAL = {0: 10, 1: 3, 2: 4, 3: 5}  # history tokens a perfect cache computes per visit


def stream(node_of_user_1="a"):
    same = [[0.5] * 8] * 2
    return [
        answer(0, 1, "a", "none", 0, 12, 0.0, 0.05, same),
        answer(1, 2, "b", "device", 40, 5, 1.0, 0.02, same),
        answer(2, 1, node_of_user_1, "shared", 10, 6, 2.0, 0.03, [[0.5] * 8, [0.5 + 1e-6] * 8], shared_bytes=4096),
        answer(3, 2, "b", "host", 44, 7, 3.0, 0.04, same),
    ]


def test_summary_counts_tiers_reloads_and_tokens_beyond_a_perfect_cache():
    p = summarize(stream(), EXPECTED, IDEAL, {}, rate=1.0)
    assert p["tiers"] == {"device": 1, "host": 1, "shared": 1, "none": 1} and p["local_fraction"] == 0.5
    assert p["reloaded_tokens"] == 10 and p["shared_reload_bytes"] == 4096
    assert p["history_tokens_computed"] == (12 - 2) + (5 - 2) + (6 - 2) + (7 - 2)
    assert p["extra_computed_tokens"] == p["history_tokens_computed"] - sum(IDEAL.values())
    assert p["reloaded_or_recomputed_tokens"] == 10 + p["extra_computed_tokens"]
    assert p["parity_ok"] and 0 < p["max_abs_logit_diff"] < 2e-6
    assert p["errors"] == 0 and p["p50_ms"] > 0


def test_repeats_pool_latencies_and_average_counts():
    one = summarize(stream(), EXPECTED, IDEAL, {}, rate=1.0)
    two = summarize_repeats([(stream(), {}), (stream(), {})], EXPECTED, IDEAL, rate=1.0)
    assert two["reloaded_tokens"] == one["reloaded_tokens"] and two["visits"] == 2 * one["visits"]
    assert [r["reloaded_or_recomputed_tokens"] for r in two["repeats"]] == [one["reloaded_or_recomputed_tokens"]] * 2


def test_fault_checks_follow_the_killed_nodes_users(tmp_path):
    extra = {"killed": "a", "killed_after_s": 1.5}
    passed = summarize(stream(node_of_user_1="c"), EXPECTED, IDEAL, extra, rate=1.0, fault=True)
    assert passed["victim_users"] == 1 and passed["victim_users_next_visit_tiers"] == {"shared": 1}
    assert passed["passed"]
    failed_stream = stream(node_of_user_1="c")
    failed_stream[2] = Sent(2, failed_stream[2].query, 0, None, 2.0, 30.0, "ServerDisconnectedError")
    failed = summarize(failed_stream, EXPECTED, IDEAL, extra, rate=1.0, fault=True)
    assert failed["errors"] == 1 and not failed["passed"]
    report = {"config": {"rate": 1.0, "nodes": 2, "visits": 4},
              "policies": {"kv-aware": summarize(stream(), EXPECTED, IDEAL, {}, 1.0),
                           "round-robin": summarize(stream(), EXPECTED, IDEAL, {}, 1.0)},
              "fault": passed}
    text = table(report)
    assert "round-robin / kv-aware: reloaded+recomputed tokens 1.0x" in text and "-> PASS" in text
    plot(report, tmp_path / "cluster.png")
    assert (tmp_path / "cluster.png").stat().st_size > 10_000
