"""The locality index: which node holds which user's K/V, on which tier, in Redis.

Kept in the Redis that holds the shared KV tier, under the model fingerprint, so that nodes of
another model never route by it (`P` = `hstu:{fingerprint}:loc`; the KV tier's own keys are
`hstu:{fingerprint}:{layout hash}:...`, so the two never meet):

* `P:node:{node_id}`        hash: url, pid, started_ms, heartbeat_ms, queue_depth, users_on_device,
                            users_on_host -- the node's heartbeat; expires `ttl` after the last one;
* `P:node:{node_id}:users`  hash: user id -> `device:{start_pos}:{length}` or `host:{start_pos}:{length}`
                            (cache positions); a user the node dropped has no field. Every write and
                            every heartbeat re-arms its expiry, so a dead node's entries vanish `ttl`
                            after its last sign of life;
* `P:nodes`                 set of node ids that ever announced themselves (a member without a live
                            `P:node:{id}` is gone);
* `P:changes`               pub/sub channel: every write is also published, in the same MULTI/EXEC,
                            as JSON `{"node": id, "set": {user: holding}, "drop": [user]}` or
                            `{"node": id, "reset": true}` (the node's hash was replaced: reload it).

The node side writes (`LocalityIndexWriter`, synchronous, from the node's publisher thread,
serve/index_publisher.py). The router keeps an in-memory mirror fed by the channel
(serve/index_mirror.py), so that routing a request costs no Redis round trip;
`LocalityIndexReader` reads Redis directly (one round trip per lookup), for the router while its
mirror is not in sync, and for tools and tests.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import redis
import redis.asyncio as aioredis

DEVICE = "device"
HOST = "host"
SHARED = "shared"
NONE = "none"
TIERS = (DEVICE, HOST, SHARED, NONE)  # where a visit's reused K/V came from, best first
NODE_TIERS = (DEVICE, HOST)  # what a node publishes; the shared tier belongs to every node


class Holding(NamedTuple):
    """What one node holds of one user: its best tier and the cached token range there."""

    tier: str  # DEVICE or HOST
    start_pos: int
    length: int


def encode(holding: Holding) -> str:
    return f"{holding.tier}:{holding.start_pos}:{holding.length}"


def decode(value: bytes | str | None) -> Holding | None:
    """The holding stored in a field (None for a missing or unreadable one: nobody holds the user there).

    A field is written only by nodes, but Redis is shared: anything else found there (other bytes,
    non-ASCII digits like "²" that str.isdigit accepts and int refuses) reads as no holding."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str):
        return None
    parts = value.split(":")
    if len(parts) != 3 or parts[0] not in NODE_TIERS or not all(_is_count(p) for p in parts[1:]):
        return None
    return Holding(parts[0], int(parts[1]), int(parts[2]))


def _is_count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 19


class IndexKeys:
    def __init__(self, namespace: str) -> None:
        if not namespace:
            raise ValueError("the locality index needs a namespace (the model fingerprint)")
        self.prefix = f"hstu:{namespace}:loc"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}:nodes"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    def users(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}:users"

    @property
    def changes(self) -> str:
        return f"{self.prefix}:changes"


def change_message(node_id: str, changes: Mapping[int, Holding | None] | None) -> str:
    """What the channel carries for a write (`changes` None: the node's hash was replaced)."""
    if changes is None:
        return json.dumps({"node": node_id, "reset": True})
    return json.dumps({
        "node": node_id,
        "set": {str(u): encode(h) for u, h in changes.items() if h is not None},
        "drop": [str(u) for u, h in changes.items() if h is None],
    })


class MalformedChange(ValueError):
    """A message on the change channel that no node wrote (see `parse_change`)."""


class IndexChange(NamedTuple):
    """One message of the change channel: a node's users set or dropped, or its whole hash replaced."""

    node: str
    reset: bool
    holdings: dict[int, Holding | None]  # user -> its holding now (None: dropped)


def parse_change(data: bytes | str) -> IndexChange:
    """The change `change_message` wrote, or MalformedChange naming what is wrong (the channel is
    shared Redis: anything may be published on it)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise MalformedChange(f"not JSON: {str(err)[:80]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
        raise MalformedChange(f"not an object with a string 'node': {str(data)[:80]!r}")
    if doc.get("reset") is True:
        return IndexChange(doc["node"], True, {})
    stored, dropped = doc.get("set", {}), doc.get("drop", [])
    if not isinstance(stored, dict) or not isinstance(dropped, list):
        raise MalformedChange(f"'set' must be an object and 'drop' a list: {str(data)[:80]!r}")
    holdings: dict[int, Holding | None] = {}
    for user, value in stored.items():
        holding = decode(value) if isinstance(value, str) else None
        if not _is_count(user) or holding is None:
            raise MalformedChange(f"set {str(user)[:30]!r}: {str(value)[:30]!r} is not a user and a holding")
        holdings[int(user)] = holding
    for user in dropped:
        if not isinstance(user, str) or not _is_count(user):
            raise MalformedChange(f"drop {str(user)[:30]!r} is not a user id")
        holdings[int(user)] = None
    return IndexChange(doc["node"], False, holdings)


class LocalityIndexWriter:
    """A node's writes. Each call is one MULTI/EXEC round trip; Redis errors propagate."""

    def __init__(self, client: redis.Redis, namespace: str, node_id: str, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be > 0, got {ttl_ms}")
        self.client = client
        self.keys = IndexKeys(namespace)
        self.node_id = node_id
        self.ttl_ms = ttl_ms

    def publish(self, changes: Mapping[int, Holding | None]) -> bool:
        """Set (Holding) or clear (None) users' fields; re-arm the expiry. -> whether the users hash
        existed before this call (False while the node holds something: it expired, resync)."""
        users = self.keys.users(self.node_id)
        stored = {str(u): encode(h) for u, h in changes.items() if h is not None}
        dropped = [str(u) for u, h in changes.items() if h is None]
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(users)
        if stored:
            pipe.hset(users, mapping=stored)
        if dropped:
            pipe.hdel(users, *dropped)
        pipe.pexpire(users, self.ttl_ms)
        pipe.publish(self.keys.changes, change_message(self.node_id, changes))
        return bool(pipe.execute()[0])

    def replace(self, holdings: Mapping[int, Holding]) -> None:
        """Make the users hash exactly `holdings` (a restart, or a resync after a lapse)."""
        users = self.keys.users(self.node_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(users)
        if holdings:
            pipe.hset(users, mapping={str(u): encode(h) for u, h in holdings.items()})
            pipe.pexpire(users, self.ttl_ms)
        pipe.publish(self.keys.changes, change_message(self.node_id, None))
        pipe.execute()

    def heartbeat(self, info: Mapping[str, object]) -> bool:
        """Refresh the node's entry and the expiry of its users. -> whether the users hash existed."""
        node, users = self.keys.node(self.node_id), self.keys.users(self.node_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(node, mapping={**{k: str(v) for k, v in info.items()}, "heartbeat_ms": str(int(time.time() * 1000))})
        pipe.pexpire(node, self.ttl_ms)
        pipe.pexpire(users, self.ttl_ms)
        pipe.sadd(self.keys.nodes, self.node_id)
        return bool(pipe.execute()[2])

    def remove(self) -> None:
        """The node leaves: its entries go at once (a graceful shutdown)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.node(self.node_id), self.keys.users(self.node_id))
        pipe.srem(self.keys.nodes, self.node_id)
        pipe.publish(self.keys.changes, change_message(self.node_id, None))
        pipe.execute()


class LocalityIndexReader:
    """Direct reads (asyncio), one round trip each. Redis errors propagate."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.keys = IndexKeys(namespace)

    async def lookup(self, user_id: int, node_ids: Sequence[str]) -> dict[str, Holding]:
        """What each of `node_ids` holds of the user (nodes holding nothing are left out)."""
        if not node_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.hget(self.keys.users(node_id), str(user_id))
        values = await pipe.execute()
        out = {}
        for node_id, value in zip(node_ids, values):
            holding = decode(value)
            if holding is not None:
                out[node_id] = holding
        return out

    async def node_holdings(self, node_id: str) -> dict[int, Holding]:
        """Everything one node holds (user -> Holding)."""
        fields = await self.client.hgetall(self.keys.users(node_id))
        decoded = {int(u): decode(h) for u, h in fields.items() if u.isascii() and u.isdigit()}
        return {u: h for u, h in decoded.items() if h is not None}
