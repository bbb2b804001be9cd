"""The Redis history store when its server fails: acknowledged appends survive kill -9, a server that
could lose them is refused, an unreachable server is an error and a returning one is used again.
No timing is asserted: the crash moments are random (seeded), the checks hold for any of them."""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from helpers import T0
from history import AppendResult, EventBatch, HistoryUnavailableError, open_history_store
from history.redis_store import RedisHistoryStore

FAR = T0 + 10**9
USERS = 5


class Writer(threading.Thread):
    """Appends batches with batch ids until the store fails; records which were acknowledged."""

    def __init__(self, store: RedisHistoryStore, label: str, videos: itertools.count) -> None:
        super().__init__(daemon=True)
        self.store, self.label, self.videos = store, label, videos
        self.acknowledged: list[EventBatch] = []
        self.in_flight: tuple[str, EventBatch] | None = None  # the append the failure interrupted
        self.error: BaseException | None = None
        self._progress = threading.Condition()

    def run(self) -> None:
        try:
            for i in itertools.count():
                video = [next(self.videos) for _ in range(10)]  # unique: every event is a new one
                batch = EventBatch.from_columns({"user_id": np.arange(10) % USERS, "video_id": np.array(video),
                                                 "time_ms": T0 + 1000 * np.array(video)})
                try:
                    self.store.append(batch, batch_id=f"{self.label}-{i}")
                except HistoryUnavailableError:
                    self.in_flight = (f"{self.label}-{i}", batch)
                    return
                with self._progress:
                    self.acknowledged.append(batch)
                    self._progress.notify_all()
        except BaseException as err:
            self.error = err
        finally:
            with self._progress:
                self._progress.notify_all()

    def wait_for(self, appends: int) -> None:
        with self._progress:
            self._progress.wait_for(lambda: len(self.acknowledged) >= appends or not self.is_alive(), timeout=60)


def stored_events(store: RedisHistoryStore) -> set[tuple[int, int, int]]:
    got = store.read(np.arange(USERS), np.full(USERS, FAR))
    users = np.repeat(got.user_ids, np.diff(got.offsets))
    return set(zip(users.tolist(), got.video_ids.tolist(), got.timestamps_ms.tolist()))


def as_set(batch: EventBatch) -> set[tuple[int, int, int]]:
    return set(zip(batch.user_id.tolist(), batch.video_id.tolist(), batch.time_ms.tolist()))


def test_acknowledged_appends_survive_kill_9(make_redis_server):
    server = make_redis_server(durable=True)
    rng = np.random.default_rng(20240501)
    videos = itertools.count()
    acknowledged: set[tuple[int, int, int]] = set()
    for round_ in range(5):
        store = RedisHistoryStore.from_url(server.url)
        writer = Writer(store, f"round{round_}", videos)
        writer.start()
        writer.wait_for(int(rng.integers(1, 40)))
        time.sleep(rng.uniform(0, 0.03))  # a random moment: between appends, or inside one
        server.kill()
        writer.join()
        store.close()
        assert writer.error is None and writer.in_flight is not None
        acknowledged |= set().union(*map(as_set, writer.acknowledged))

        server.restart()
        with RedisHistoryStore.from_url(server.url) as check:
            stored = stored_events(check)
            assert acknowledged <= stored
            batch_id, batch = writer.in_flight  # the interrupted append: all of it or none
            assert len(as_set(batch) & stored) in (0, len(batch))
            assert stored == acknowledged | (as_set(batch) & stored)
            # Retrying it with its batch_id tells which: replayed if it had been applied.
            replayed = check.append(batch, batch_id=batch_id).replayed
            assert replayed == (as_set(batch) <= stored)
            acknowledged |= as_set(batch)
            assert check.num_events() == len(acknowledged)


def test_a_server_that_could_lose_acknowledged_appends_is_refused(private_redis_server):
    url = private_redis_server.url  # runs with appendonly no
    with pytest.raises(ValueError, match="appendonly=no"):
        RedisHistoryStore.from_url(url)
    client = private_redis_server.client()
    client.config_set("appendonly", "yes")
    client.config_set("appendfsync", "everysec")
    with pytest.raises(ValueError, match="appendfsync=everysec"):
        RedisHistoryStore.from_url(url)
    client.config_set("appendfsync", "always")
    RedisHistoryStore.from_url(url).close()
    private_redis_server.kill()  # a SIGTERM is refused while the AOF that `appendonly yes` began is written


def test_without_config_the_server_is_refused_unless_fsync_is_waived(make_redis_server):
    server = make_redis_server(durable=True, extra_args=["--rename-command", "CONFIG", ""])
    with pytest.raises(ValueError, match="require_fsync=False"):
        RedisHistoryStore.from_url(server.url)
    with RedisHistoryStore.from_url(server.url, require_fsync=False) as store:
        assert store.append(EventBatch.from_records([{"user_id": 1, "video_id": 2, "time_ms": T0}])).appended == 1


def test_an_unreachable_server_is_unavailable_and_a_returning_one_is_used_again(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url, timeout_s=2)
    first = EventBatch.from_records([{"user_id": 1, "video_id": 2, "time_ms": T0}])
    store.append(first)
    server.kill()
    one = np.array([1])
    calls = [lambda: store.append(first), lambda: store.read(one, one), lambda: store.counts(one, one),
             store.stored_user_ids, store.num_events, store.get_manifest]
    for call in calls:
        with pytest.raises(HistoryUnavailableError):
            call()
    with pytest.raises(HistoryUnavailableError):
        RedisHistoryStore.from_url(server.url, timeout_s=2)

    server.restart()  # an empty script cache: the store loads its script again
    second = EventBatch.from_records([{"user_id": 1, "video_id": 3, "time_ms": T0 + 1}])
    assert store.append(second) == AppendResult(1, 0, 0)
    assert store.read(one, np.array([FAR])).video_ids.tolist() == [2, 3]
    store.close()


def test_a_full_server_refuses_the_whole_append(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url)
    store.append(EventBatch.from_records([{"user_id": 1, "video_id": 2, "time_ms": T0}]))
    server.client().config_set("maxmemory", 1)  # over the limit now (noeviction: writes are refused)
    batch = EventBatch.from_records([{"user_id": u, "video_id": 3, "time_ms": T0 + u} for u in range(1, 6)])
    with pytest.raises(HistoryUnavailableError, match="maxmemory"):
        store.append(batch)
    server.client().config_set("maxmemory", 0)
    assert store.stored_user_ids().tolist() == [1] and store.num_events() == 1
    assert store.append(batch) == AppendResult(5, 0, 0)
    store.close()


def test_description_names_the_server_without_credentials():
    store = RedisHistoryStore.from_url("redis://reader:s3cret@127.0.0.1:6390/3", require_fsync=False)
    assert store.description == "redis://127.0.0.1:6390/3"
    unix = RedisHistoryStore.from_url("unix://:s3cret@/run/redis.sock?db=2", require_fsync=False)
    assert unix.description == "unix:///run/redis.sock?db=2"


def test_the_registry_opens_redis_urls(durable_redis_server):
    with open_history_store(durable_redis_server) as store:
        assert isinstance(store, RedisHistoryStore) and store.description == durable_redis_server
