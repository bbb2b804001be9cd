"""The router's in-memory mirror of the locality index, so that routing costs no Redis round trip.

It subscribes to the index's change channel first, then loads a snapshot of every announced
node's users, then applies each change message in order. Messages that arrive while the
snapshot loads are applied on top of it; they are states, not deltas, so re-applying one that
the snapshot already reflects converges to the same state. A `reset` message (a node replaced
its whole hash: a restart, a resync) reloads that node. Every `check_interval_s` the nodes whose
heartbeat key expired are dropped: a dead node's entries vanish here as they do in Redis.

While it is not in sync (starting, Redis unreachable) `synced` is False and the router reads
Redis directly instead (`LocalityIndexReader.lookup`).

The channel is shared Redis, so a message may be anything: one that no node could have written
is logged, counted (`malformed_messages`) and answered with a resync (a fresh snapshot), since the
change it stood for, if any, is lost. An unexpected error restarts the mirror the same way; it
never stops following while the router runs.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from serve.locality_index import Holding, IndexChange, IndexKeys, LocalityIndexReader, MalformedChange, parse_change

log = logging.getLogger("serve.router")


class IndexMirror:
    def __init__(self, client: aioredis.Redis, namespace: str, check_interval_s: float = 0.5) -> None:
        self.client = client
        self.keys = IndexKeys(namespace)
        self.reader = LocalityIndexReader(client, namespace)
        self.check_interval_s = check_interval_s
        self.synced = False
        self.messages = 0  # change messages applied
        self.resyncs = 0  # snapshots loaded (the first one included)
        self.malformed_messages = 0  # change messages no node could have written (each one resyncs)
        self._by_node: dict[str, dict[int, Holding]] = {}

    def holdings(self, user_id: int, node_ids: Sequence[str]) -> dict[str, Holding]:
        """What each of `node_ids` holds of the user, as last heard (nodes holding nothing are left out)."""
        out = {}
        for node_id in node_ids:
            holding = self._by_node.get(node_id, {}).get(user_id)
            if holding is not None:
                out[node_id] = holding
        return out

    async def run(self) -> None:
        """Follow the index until cancelled; after a Redis error, start over with a fresh snapshot."""
        while True:
            try:
                await self._follow()
            except (aioredis.RedisError, OSError, asyncio.TimeoutError, ValueError) as err:
                log.warning("locality index mirror lost sync (%s: %s); routing reads Redis until it resyncs",
                            type(err).__name__, err)
            except Exception:  # a bug must not end the mirror for good: log it and start over
                log.exception("locality index mirror failed; routing reads Redis until it resyncs")
            self.synced = False
            await asyncio.sleep(self.check_interval_s)

    async def _follow(self) -> None:
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(self.keys.changes)
            confirmed = await pubsub.get_message(timeout=5.0)
            if not confirmed or confirmed.get("type") != "subscribe":
                raise ValueError(f"no subscription confirmation (got {confirmed!r})")
            await self._snapshot()
            loop = asyncio.get_running_loop()
            next_check = loop.time() + self.check_interval_s
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=max(0.0, next_check - loop.time()))
                if message is not None and message.get("type") == "message":
                    await self._receive(message["data"])
                if loop.time() >= next_check:
                    await self._drop_expired()
                    next_check = loop.time() + self.check_interval_s
        finally:
            self.synced = False
            await pubsub.aclose()

    async def _snapshot(self) -> None:
        members = sorted(m.decode() for m in await self.client.smembers(self.keys.nodes))
        self._by_node = {node: await self.reader.node_holdings(node) for node in members}
        await self._drop_expired()
        self.resyncs += 1
        self.synced = True

    async def _receive(self, data: bytes) -> None:
        try:
            change = parse_change(data)
        except MalformedChange as err:
            self.malformed_messages += 1
            log.warning("locality index mirror: a malformed change message (%s); resyncing", err)
            await self._snapshot()
            return
        await self._apply(change)

    async def _apply(self, change: IndexChange) -> None:
        self.messages += 1
        if change.reset:
            self._by_node[change.node] = await self.reader.node_holdings(change.node)
            return
        held = self._by_node.setdefault(change.node, {})
        for user, holding in change.holdings.items():
            if holding is None:
                held.pop(user, None)
            else:
                held[user] = holding

    async def _drop_expired(self) -> None:
        """Forget nodes whose heartbeat key expired."""
        nodes = list(self._by_node)
        if not nodes:
            return
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.exists(self.keys.node(node))
        for node, alive in zip(nodes, await pipe.execute()):
            if not alive:
                self._by_node.pop(node, None)
