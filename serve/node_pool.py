"""The router's view of its nodes: which answer, what each is called in the index, what it has in flight.

A node is *up* after its /health answered 200 with the model fingerprint the pool serves, and
*down* after a probe or a forwarded request failed (connection refused or reset, timeout, a
503 "draining"). A probe loop asks every node's /health each `interval_s`, so a node that comes
back (restarted) is used again, and one that stopped answering between requests is taken out
even if nobody was routed to it. Taking a node out abandons the requests in flight to it (their
forwards are cancelled and `Forward.abandoned` says so), so that a hung node holds a request no
longer than its probe takes to notice, not for the whole forward timeout.

All state lives on the router's event loop: no locks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("serve.router")


@dataclass
class NodeState:
    address: str  # host:port, as given to the router
    node_id: str  # as the node names itself (its key in the locality index); the address until it answers
    up: bool = False
    in_flight: int = 0
    last_error: str = ""
    forwards: dict[asyncio.Task, Forward] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class Forward:
    """One request in flight to a node, as the task awaiting its answer."""

    task: asyncio.Task
    abandoned: bool = False  # the node was taken out under it: its answer is not awaited


def parse_addresses(text: str | Sequence[str]) -> list[str]:
    """'h1:p1,h2:p2' (or a list) -> ['h1:p1', 'h2:p2'], checked."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip().removeprefix("http://").rstrip("/") for i in items):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"node address {item!r} is not HOST:PORT")
        out.append(item)
    if len(set(out)) != len(out) or not out:
        raise ValueError(f"node addresses must be distinct and at least one: {out}")
    return out


class NodePool:
    def __init__(self, addresses: Sequence[str], probe_timeout_s: float = 2.0) -> None:
        self.nodes = [NodeState(a, a) for a in addresses]
        self.probe_timeout_s = probe_timeout_s
        self.fingerprint = ""  # the model every node must serve (the first answer sets it)

    def live(self) -> list[NodeState]:
        return [n for n in self.nodes if n.up]

    def by_id(self, node_id: str) -> NodeState:
        return next(n for n in self.nodes if n.node_id == node_id)

    def mark_down(self, node: NodeState, reason: str, abandon: bool = True) -> None:
        """Take the node out; with `abandon`, cancel the forwards in flight to it (a node that drains,
        answering what it holds, is taken out without)."""
        if node.up:
            log.warning("node %s (%s) taken out: %s", node.node_id, node.address, reason)
        node.up = False
        node.last_error = reason
        if abandon:
            for forward in node.forwards.values():
                if not forward.abandoned:
                    forward.abandoned = True
                    forward.task.cancel(f"node {node.node_id} taken out: {reason}")

    @contextlib.asynccontextmanager
    async def forwarding(self, node: NodeState) -> AsyncIterator[Forward]:
        """Around one forward to `node`: counts it in flight, and when the node is taken out meanwhile
        ends the block early with `abandoned` set instead of a cancellation (any other error passes)."""
        task = asyncio.current_task()
        forward = Forward(task)
        node.forwards[task] = forward
        node.in_flight += 1
        try:
            yield forward
        except asyncio.CancelledError:
            if not forward.abandoned:
                raise  # the request itself was cancelled (its client left, the router stops)
            task.uncancel()
        finally:
            node.in_flight -= 1
            del node.forwards[task]

    def _mark_up(self, node: NodeState, health: dict) -> None:
        fingerprint = str(health.get("model_fingerprint", ""))
        if self.fingerprint and fingerprint != self.fingerprint:
            self.mark_down(node, f"serves model {fingerprint[:12]}, the pool serves {self.fingerprint[:12]}")
            return
        self.fingerprint = self.fingerprint or fingerprint
        node.node_id = str(health.get("node_id") or node.address)
        if not node.up:
            log.info("node %s (%s) is up", node.node_id, node.address)
        node.up = True
        node.last_error = ""

    async def probe(self, session: aiohttp.ClientSession, node: NodeState) -> bool:
        """Ask the node's /health; mark it up or down accordingly."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
            async with session.get(f"{node.url}/health", timeout=timeout) as resp:
                health = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            self.mark_down(node, f"health probe failed: {type(err).__name__}: {err}")
            return False
        if status != 200 or not isinstance(health, dict):
            self.mark_down(node, f"health probe answered {status}: {health}")
            return False
        self._mark_up(node, health)
        return node.up

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, n) for n in self.nodes))

    async def probe_forever(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_all(session)

    def describe(self) -> list[dict]:
        return [{"address": n.address, "node_id": n.node_id, "up": n.up, "in_flight": n.in_flight,
                 "last_error": n.last_error} for n in self.nodes]
