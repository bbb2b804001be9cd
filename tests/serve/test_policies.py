"""Routing policies as pure functions of the live nodes, their queues and the index's holdings."""
from __future__ import annotations

from collections import Counter

import pytest

from serve.locality_index import DEVICE, HOST, Holding
from serve.policies import POLICY_NAMES, KVAware, NodeView, make_policy

NODES = [NodeView(f"n{i}", 0) for i in range(4)]


def test_round_robin_takes_turns_and_random_spreads():
    rr = make_policy("round-robin")
    assert [rr.choose(7, NODES) for _ in range(8)] == ["n0", "n1", "n2", "n3"] * 2
    rnd = make_policy("random", seed=1)
    counts = Counter(rnd.choose(7, NODES) for _ in range(4000))
    assert set(counts) == {"n0", "n1", "n2", "n3"} and min(counts.values()) > 850


def test_sticky_hash_is_stable_balanced_and_moves_only_a_dead_nodes_users():
    sticky = make_policy("sticky-hash")
    before = {u: sticky.choose(u, NODES) for u in range(2000)}
    assert before == {u: sticky.choose(u, list(reversed(NODES))) for u in range(2000)}  # order-free
    assert min(Counter(before.values()).values()) > 400
    survivors = [n for n in NODES if n.node_id != "n2"]
    after = {u: sticky.choose(u, survivors) for u in range(2000)}
    moved = {u for u in before if before[u] != after[u]}
    assert moved == {u for u in before if before[u] == "n2"}
    assert len(Counter(after[u] for u in moved)) == 3  # spread over the others


def views(holdings: dict[str, Holding], in_flight: dict[str, int] | None = None) -> list[NodeView]:
    in_flight = in_flight or {}
    return [NodeView(n.node_id, in_flight.get(n.node_id, 0), holdings.get(n.node_id)) for n in NODES]


def test_kv_aware_prefers_the_most_cached_tokens_device_before_host():
    kv = KVAware()  # queues equal: the cache decides
    assert kv.choose(5, views({"n1": Holding(HOST, 0, 100), "n3": Holding(DEVICE, 0, 300)})) == "n3"
    assert kv.choose(5, views({"n1": Holding(HOST, 0, 400), "n3": Holding(DEVICE, 0, 300)})) == "n1"
    assert kv.choose(5, views({"n1": Holding(HOST, 0, 300), "n3": Holding(DEVICE, 0, 300)})) == "n3"  # same length


def test_kv_aware_discounts_by_queue_depth():
    holdings = {"n1": Holding(DEVICE, 0, 200), "n2": Holding(HOST, 0, 100)}
    # load_slack=0: only the least busy nodes are eligible; the cache decides among them.
    assert KVAware().choose(5, views(holdings, {"n1": 1, "n2": 0, "n0": 1, "n3": 1})) == "n2"
    assert KVAware().choose(5, views(holdings, {"n1": 1, "n2": 1, "n0": 1, "n3": 1})) == "n1"
    # load_slack=2: a node up to two requests busier stays eligible, its cache discounted per request.
    kv = KVAware(load_slack=2, queue_cost_tokens=50)
    assert kv.choose(5, views(holdings, {"n1": 2})) == "n1"  # 200 - 2 * 50 > 0.8 * 100
    assert KVAware(load_slack=2, queue_cost_tokens=80).choose(5, views(holdings, {"n1": 2})) == "n2"  # 200 - 2 * 80 < 0.8 * 100
    assert kv.choose(5, views(holdings, {"n1": 3})) == "n2"  # beyond the slack
    # Nobody holds the user: the shortest queue, then the sticky node.
    busy = {"n0": 2, "n1": 1, "n2": 1, "n3": 0}
    assert KVAware().choose(5, views({}, busy)) == "n3"
    sticky = make_policy("sticky-hash")
    for user in range(50):
        assert KVAware().choose(user, views({})) == sticky.choose(user, NODES)


def test_make_policy_names():
    assert [make_policy(name).name for name in POLICY_NAMES] == list(POLICY_NAMES)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")
