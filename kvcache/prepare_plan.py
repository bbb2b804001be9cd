"""Planning a prepare: validate a whole batch against the cache, then read what it onloads.

`plan_prepare` mutates nothing: a batch it refuses leaves every tier and every page as it was.
`read_planned` runs after the room for the batch is made; a tier that cannot return what it
reported refuses the batch as stale (the caller re-plans). The manager's lock is held for both.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cache_version import CacheVersion, check_version
from .errors import KVCacheCapacityError, KVCacheRequestError, KVCacheStaleError
from .residency import Residency
from .storage import HostEntry, HostPages
from .validation import UserIds, check_continues, check_expected, check_range, int_list, tag_list, user_id_list


@dataclass(frozen=True)
class PreparePlan:
    """A validated prepare: nothing has been mutated yet."""

    user_ids: list[int]
    start_pos: list[int]
    new_lengths: list[int]
    on_host: dict[int, HostEntry]  # users to onload, with the entries their tier reported
    pages_needed: int  # fresh device pages for the batch: onloaded users' and new tokens'
    tags: list[bytes] | None  # applied at commit


def plan_prepare(
    residency: Residency,
    user_ids: UserIds,
    start_pos: UserIds,
    new_lengths: UserIds,
    tags: Sequence[bytes] | None,
    expected_cached_lengths: UserIds | None,
    expected_versions: Sequence[CacheVersion] | None = None,
) -> PreparePlan:
    """Check every user of the batch (docs/kvcache.md lists the refusals) and count its pages."""
    users = user_id_list(user_ids)
    starts = int_list(start_pos, "start_pos")
    news = int_list(new_lengths, "new_lengths")
    expected = None if expected_cached_lengths is None else int_list(expected_cached_lengths, "expected_cached_lengths")
    if not len(users) == len(starts) == len(news) == (len(users) if expected is None else len(expected)):
        named = f"{len(users)}, {len(starts)}, {len(news)}" + ("" if expected is None else f", {len(expected)}")
        raise KVCacheRequestError(f"user_ids, start_pos, new_lengths and expected_cached_lengths differ in length: {named}.")
    if expected_versions is not None and len(expected_versions) != len(users):
        raise KVCacheRequestError(f"expected_versions holds {len(expected_versions)} versions for {len(users)} users.")
    user_tags = None if tags is None else tag_list(tags, len(users))
    if len(set(users)) != len(users):
        seen: set[int] = set()
        dup = next(u for u in users if u in seen or seen.add(u))
        raise KVCacheRequestError(f"User {dup} appears more than once in the batch.")
    page_size = residency.layout.page_size
    on_host: dict[int, HostEntry] = {}
    need = held = 0
    for b, (u, start, new) in enumerate(zip(users, starts, news)):
        check_range(u, start, new)
        if u in residency.in_flight:
            raise KVCacheRequestError(f"User {u} has a prepare in flight; commit or roll it back first.")
        res = residency.users.get(u)
        if res is not None:
            cached_start, cached_len, have = res.start_pos, res.length, len(res.pages)
            held += residency.live_pages(res)
        else:
            h = residency.host.info(u)
            cached_start, cached_len, have = (h.start_pos, h.length, 0) if h is not None else (start, 0, 0)
            if h is not None:
                on_host[u] = h
                have = residency.release.released_count(h.length)  # pages an onload does not allocate
        if expected is not None:
            check_expected(u, start, expected[b], cached_start, cached_len)
        if expected_versions is not None:
            check_version(u, expected_versions[b], residency.version(u))
        if cached_len:
            check_continues(u, start, cached_start, cached_start + cached_len)
        need += -(-(cached_len + new) // page_size) - have
    num_pages = residency.pool.num_pages
    in_flight = sum(residency.live_pages(residency.users[u]) for u in residency.in_flight)
    available = num_pages - held - in_flight
    if need > available:
        raise KVCacheCapacityError(
            f"The batch needs {need} more pages but the pool can free at most {available} for it "
            f"(num_pages={num_pages}; {held} held by the batch, {in_flight} by prepares in flight)."
        )
    return PreparePlan(users, starts, news, on_host, need, user_tags)


def read_planned(residency: Residency, plan: PreparePlan) -> dict[int, HostPages]:
    """Read what the plan onloads.

    The in-memory tier keeps it (victims' offloads protected it). A persistent or shared tier
    may fail to return what `info` reported (a failure, a checksum, another node, a TTL): the
    batch continued data that is not there, so it is refused as stale (after the evictions),
    and an unreadable entry is dropped so that the next `get_user_kvdata_info` reports a miss.
    """
    host = residency.host
    out, failed = {}, []
    if plan.on_host:
        residency.pool.sync_onloads()  # a read may promote into host memory an onload still reads
    for u, entry in plan.on_host.items():
        hp = host.read(u)
        if hp is None or hp.entry != entry:
            if hp is None:
                host.drop(u)
            failed.append(f"user {u} up to position {entry.start_pos + entry.length - 1}")
        else:
            out[u] = hp
    if failed:  # all of them at once: one re-plan of the batch is enough
        raise KVCacheStaleError(
            f"The host tier could not return the cached tokens of {', '.join(failed)} (lost, unreadable or "
            "changed); call get_user_kvdata_info again and recompute from what is cached."
        )
    return out
