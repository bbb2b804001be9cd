"""Routing policies: which live node serves a user's request.

A policy sees the live nodes (in a stable order), each with the requests the router has in
flight to it and, for `kv-aware`, what the locality index says it holds of the user. It is a
pure function of those (plus its own counter or random state), so it is tested without HTTP.

* `round-robin`: the next node in turn.
* `random`: a uniformly random node.
* `sticky-hash`: rendezvous hashing of (user, node): a user always lands on the same node while
  it lives; when a node dies only its users move, spread over the others.
* `kv-aware`: the node holding the most of the user's K/V, device before host before the shared
  tier (which every node reaches alike), discounted by queue depth. A node whose queue is more
  than `load_slack` requests longer than the shortest one is passed over (the more so the longer
  its excess); among the others

      score(node) = tier_weight[tier] * cached_tokens - queue_cost_tokens * in_flight(node)

  decides. Ties (e.g. nobody holds the user) go to the shorter queue, then to sticky-hash's
  choice, so a new user is spread evenly and finds the same node again before the index has
  heard of it. Why the queue comes first: with a shared tier a user away from home is reloaded,
  not recomputed (about 10 ms for a 2,000-token window here), while a request queued behind a
  batch waits for the whole batch (100 ms and more on CPU): locality decides among the nodes that
  would serve the request about as soon, and at low load that is all of them.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from serve.locality_index import DEVICE, HOST, Holding

POLICY_NAMES = ("kv-aware", "round-robin", "random", "sticky-hash")


class NodeView(NamedTuple):
    node_id: str
    in_flight: int  # requests the router has sent and not yet had answered
    holding: Holding | None = None  # from the locality index (kv-aware only)


class RoutingPolicy(ABC):
    name: str = ""
    uses_index: bool = False

    @abstractmethod
    def choose(self, user_id: int, nodes: Sequence[NodeView]) -> str:
        """The id of the node to serve `user_id` (`nodes` is non-empty)."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, user_id: int, nodes: Sequence[NodeView]) -> str:
        return nodes[next(self._turn) % len(nodes)].node_id


class RandomChoice(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, user_id: int, nodes: Sequence[NodeView]) -> str:
        return nodes[self._rng.randrange(len(nodes))].node_id


def rendezvous_weight(user_id: int, node_id: str) -> int:
    digest = hashlib.blake2b(f"{user_id}\x00{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class StickyHash(RoutingPolicy):
    name = "sticky-hash"

    def choose(self, user_id: int, nodes: Sequence[NodeView]) -> str:
        return max(nodes, key=lambda n: rendezvous_weight(user_id, n.node_id)).node_id


@dataclass(frozen=True)
class KVAware(RoutingPolicy):
    """See the module docstring. `load_slack`: how many requests longer than the shortest a node's
    queue may be and still be chosen for its cache; `queue_cost_tokens`: how many cached tokens one
    request ahead in an eligible node's queue is worth giving up."""

    load_slack: int = 0
    queue_cost_tokens: float = 64.0
    tier_weights: Mapping[str, float] = field(default_factory=lambda: {DEVICE: 1.0, HOST: 0.8})
    name: str = "kv-aware"
    uses_index: bool = True

    def score(self, node: NodeView) -> float:
        held = 0.0
        if node.holding is not None:
            held = self.tier_weights.get(node.holding.tier, 0.0) * node.holding.length
        return held - self.queue_cost_tokens * node.in_flight

    def choose(self, user_id: int, nodes: Sequence[NodeView]) -> str:
        shortest = min(n.in_flight for n in nodes)

        def rank(n: NodeView):
            excess = max(0, n.in_flight - shortest - self.load_slack)
            return -excess, self.score(n), -n.in_flight, rendezvous_weight(user_id, n.node_id)

        return max(nodes, key=rank).node_id


def make_policy(name: str, seed: int | None = None, queue_cost_tokens: float = 64.0, load_slack: int = 0) -> RoutingPolicy:
    if name == "kv-aware":
        return KVAware(load_slack=load_slack, queue_cost_tokens=queue_cost_tokens)
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(seed)
    if name == "sticky-hash":
        return StickyHash()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "KVAware", "NodeView", "RandomChoice", "RoundRobin", "RoutingPolicy", "StickyHash",
           "make_policy", "rendezvous_weight"]
