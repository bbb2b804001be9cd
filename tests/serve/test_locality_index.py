"""The locality index in a real Redis: the node's writes, the router's reads, expiry with the heartbeat."""
from __future__ import annotations

import asyncio
import contextlib
import time

import redis
import redis.asyncio as aioredis

from benchmark.harness.launch import wait_until
from helpers import unique_namespace
from kvcache import CacheEvent, CacheLocation
from serve.index_mirror import IndexMirror
from serve.index_publisher import IndexPublisher
from serve.locality_index import (
    DEVICE,
    HOST,
    Holding,
    IndexKeys,
    LocalityIndexReader,
    LocalityIndexWriter,
    decode,
    encode,
)


def lookup(url: str, namespace: str, user: int, nodes: list[str]) -> dict[str, Holding]:
    async def main():
        client = aioredis.Redis.from_url(url)
        try:
            return await LocalityIndexReader(client, namespace).lookup(user, nodes)
        finally:
            await client.aclose()

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def _following(url: str, namespace: str):
    """-> (an IndexMirror following the index, its task, its client), stopped on exit."""
    aio = aioredis.Redis.from_url(url)
    mirror = IndexMirror(aio, namespace, check_interval_s=0.05)
    task = asyncio.ensure_future(mirror.run())
    try:
        yield mirror, task, aio
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await aio.aclose()


async def _until(predicate, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


def test_encoding_round_trips_and_refuses_junk():
    holding = Holding(DEVICE, 64, 130)
    assert decode(encode(holding)) == holding and decode(encode(holding).encode()) == holding
    for junk in (None, b"", b"shared:0:1", b"device:-1:2", b"device:1", b"host:a:b"):
        assert decode(junk) is None


def test_writes_are_read_back_per_node_and_expire_without_heartbeat(redis_server):
    namespace = unique_namespace("loc")
    client = redis.Redis.from_url(redis_server)
    a = LocalityIndexWriter(client, namespace, "a", ttl_ms=60_000)
    b = LocalityIndexWriter(client, namespace, "b", ttl_ms=300)
    a.publish({1: Holding(DEVICE, 0, 40), 2: Holding(HOST, 0, 8)})
    b.publish({1: Holding(HOST, 0, 50)})
    assert lookup(redis_server, namespace, 1, ["a", "b", "c"]) == {"a": Holding(DEVICE, 0, 40), "b": Holding(HOST, 0, 50)}
    a.publish({2: None})
    assert lookup(redis_server, namespace, 2, ["a", "b"]) == {}
    # b stops beating: its entries vanish after its TTL; a's stay.
    assert wait_until(lambda: lookup(redis_server, namespace, 1, ["a", "b"]) == {"a": Holding(DEVICE, 0, 40)}, 5.0)
    # Another model's index is another namespace.
    assert lookup(redis_server, unique_namespace("other"), 1, ["a"]) == {}
    a.remove()
    assert lookup(redis_server, namespace, 1, ["a"]) == {}


def events(*items: tuple[int, CacheLocation, int]) -> list[CacheEvent]:
    return [CacheEvent(user, location, 0, length) for user, location, length in items]


def test_the_publisher_follows_cache_events_beats_and_resyncs_after_a_lapse(redis_server):
    namespace = unique_namespace("pub")
    client = redis.Redis.from_url(redis_server)
    writer = LocalityIndexWriter(client, namespace, "n1", ttl_ms=2_000)
    client.hset(writer.keys.users("n1"), "99", encode(Holding(DEVICE, 0, 5)))  # left by a previous process
    publisher = IndexPublisher(writer, heartbeat_s=0.1, node_info=lambda: {"queue_depth": 3}, advertised_url="http://x")
    publisher.start()
    try:
        publisher.listener(events((1, CacheLocation.DEVICE, 10), (2, CacheLocation.DEVICE, 20)))
        publisher.listener(events((1, CacheLocation.HOST, 10), (2, CacheLocation.NONE, 0), (3, CacheLocation.DEVICE, 7)))
        expected = {"1": encode(Holding(HOST, 0, 10)), "3": encode(Holding(DEVICE, 0, 7))}

        def stored():
            return {k.decode(): v.decode() for k, v in client.hgetall(writer.keys.users("n1")).items()}

        assert wait_until(lambda: stored() == expected, 5.0), stored()

        def info():
            return {k.decode(): v.decode() for k, v in client.hgetall(writer.keys.node("n1")).items()}

        assert wait_until(lambda: info().get("users_on_device") == "1", 5.0), info()  # the next beat counts them
        assert info()["queue_depth"] == "3" and info()["url"] == "http://x" and info()["users_on_host"] == "1"
        assert 0 < client.pttl(writer.keys.users("n1")) <= 2_000
        # The entries are lost (a flush, an expiry during a pause): the publisher rewrites them.
        client.delete(writer.keys.users("n1"))
        assert wait_until(lambda: stored() == expected, 5.0)
    finally:
        publisher.stop(remove=True)
    assert not client.exists(writer.keys.users("n1")) and not client.exists(writer.keys.node("n1"))


def test_a_dead_publishers_entries_vanish_with_its_heartbeat(redis_server):
    namespace = unique_namespace("dead")
    client = redis.Redis.from_url(redis_server)
    writer = LocalityIndexWriter(client, namespace, "gone", ttl_ms=400)
    publisher = IndexPublisher(writer, heartbeat_s=0.1)
    publisher.start()
    publisher.listener(events((5, CacheLocation.DEVICE, 9)))
    assert wait_until(lambda: lookup(redis_server, namespace, 5, ["gone"]) != {}, 5.0)
    time.sleep(0.6)
    assert lookup(redis_server, namespace, 5, ["gone"]) != {}  # beating: still there past the TTL
    publisher.stop(remove=False)  # dies without leaving
    assert wait_until(lambda: lookup(redis_server, namespace, 5, ["gone"]) == {}, 3.0)


def test_the_routers_mirror_follows_changes_resets_and_dead_nodes(redis_server):
    namespace = unique_namespace("mirror")
    client = redis.Redis.from_url(redis_server)
    early = LocalityIndexWriter(client, namespace, "early", ttl_ms=60_000)
    early.heartbeat({})
    early.publish({1: Holding(DEVICE, 0, 10)})  # before the mirror starts: it comes with the snapshot
    mortal = LocalityIndexWriter(client, namespace, "mortal", ttl_ms=500)

    async def main():
        async with _following(redis_server, namespace) as (mirror, _, _):
            assert await _until(lambda: mirror.synced)
            assert mirror.holdings(1, ["early", "mortal"]) == {"early": Holding(DEVICE, 0, 10)}
            early.publish({1: Holding(HOST, 0, 10), 2: Holding(DEVICE, 4, 20)})
            mortal.heartbeat({})
            mortal.publish({2: Holding(DEVICE, 4, 30)})
            assert await _until(lambda: mirror.holdings(2, ["early", "mortal"]) ==
                               {"early": Holding(DEVICE, 4, 20), "mortal": Holding(DEVICE, 4, 30)})
            assert mirror.holdings(1, ["early"]) == {"early": Holding(HOST, 0, 10)}
            early.replace({3: Holding(DEVICE, 0, 5)})  # a restarted node: the mirror reloads it
            assert await _until(lambda: mirror.holdings(1, ["early"]) == {} and mirror.holdings(3, ["early"]) != {})
            # mortal stops beating: the mirror forgets it when its heartbeat key expires.
            assert await _until(lambda: mirror.holdings(2, ["early", "mortal"]) == {})
            assert mirror.messages >= 3 and mirror.resyncs == 1

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_mirror_survives_malformed_messages_and_values_read_as_nobody_holds_it(redis_server):
    """Redis is shared: a message no node wrote is logged, counted and resynced from; a value no node
    wrote is no holding, in the mirror and in a direct lookup (issue 21: the mirror died for good)."""
    namespace = unique_namespace("malformed")
    client = redis.Redis.from_url(redis_server)
    node = LocalityIndexWriter(client, namespace, "n", ttl_ms=60_000)
    node.heartbeat({})
    node.publish({1: Holding(DEVICE, 0, 10)})
    keys = IndexKeys(namespace)

    async def main():
        async with _following(redis_server, namespace) as (mirror, task, aio):
            assert await _until(lambda: mirror.synced)
            client.hset(keys.users("n"), mapping={"2": b"\xff\xfe", "3": "device:\xb2:1"})  # a bad value, unannounced
            for junk in ("[1,2]", "not json", '{"node": 7}', '{"node": "n", "set": {"x": "device:0:1"}}',
                         '{"node": "n", "drop": [null]}'):
                client.publish(keys.changes, junk)
            assert await _until(lambda: mirror.malformed_messages == 5)
            node.publish({4: Holding(HOST, 0, 3)})  # the mirror still follows
            assert await _until(lambda: mirror.holdings(4, ["n"]) == {"n": Holding(HOST, 0, 3)})
            assert mirror.synced and mirror.resyncs >= 2 and not task.done()
            assert mirror.holdings(1, ["n"]) == {"n": Holding(DEVICE, 0, 10)}
            assert mirror.holdings(2, ["n"]) == {} and mirror.holdings(3, ["n"]) == {}
            direct = LocalityIndexReader(aio, namespace)
            assert await direct.lookup(2, ["n"]) == {} and await direct.lookup(3, ["n"]) == {}

    asyncio.run(asyncio.wait_for(main(), 30))
