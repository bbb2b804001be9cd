"""A race on one user in the shared Redis tier stays that user's: its write is not stored, and the
tier stays on for everyone else (issue 21: a 'would leave a gap' error used to switch the whole
tier off for a second and more)."""
from __future__ import annotations

from helpers import TINY_LAYOUT_ARGS, host_pages, unique_namespace
from kvcache import HostEntry, PageLayout, TieredHostStorage
from kvcache.storage.fail_open import FailOpenStorage
from kvcache.storage.redis_tier import RedisHostStorage

LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)


def _redis(url: str, namespace: str) -> RedisHostStorage:
    tier = RedisHostStorage(url, namespace, 64 * LAYOUT.page_nbytes)
    tier.bind(LAYOUT)
    return tier


def _fill(n: int, seed: int = 0):
    pages = host_pages(LAYOUT, n, seed=seed)
    return lambda dst: dst.copy_(pages)


def test_an_entry_dropped_by_another_node_before_an_incremental_write_costs_only_that_user(redis_server):
    ns = unique_namespace()
    this_node = FailOpenStorage(_redis(redis_server, ns), "redis")
    this_node.bind(LAYOUT)
    other_node = _redis(redis_server, ns)
    assert this_node.write(1, 0, 4, 0, _fill(1)).stored  # one page
    other_node.drop(1)  # e.g. the other node restarted user 1's window
    # this node still believes it wrote user 1's first page, and sends only the second
    assert this_node.write(1, 0, 8, 1, _fill(1, seed=1)) == (False, ())
    assert this_node.info(1) is None
    assert this_node.write(2, 0, 4, 0, _fill(1, seed=2)).stored  # the tier is still on
    assert this_node.info(2) == HostEntry(0, 4)
    counters = this_node.counters()
    assert counters["failures"] == 0 and counters["skipped"] == 0 and counters["write_conflicts"] == 1


def test_the_chain_does_not_raise_when_its_base_vanished_between_info_and_write(redis_server):
    """The manager plans an incremental offload from `info`; the shared entry it continues is gone by the write."""
    ns = unique_namespace()
    chain = TieredHostStorage([FailOpenStorage(_redis(redis_server, ns), "redis")])
    chain.bind(LAYOUT)
    other_node = _redis(redis_server, ns)
    assert chain.write(1, 0, 4, 0, _fill(1)).stored
    assert chain.info(1) == HostEntry(0, 4)
    other_node.drop(1)
    assert chain.write(1, 0, 8, 1, _fill(1, seed=1)) == (False, ())
    assert chain.write(1, 0, 8, 0, _fill(2, seed=1)).stored  # the next offload writes it whole
    assert chain.info(1) == HostEntry(0, 8) and chain.counters()["failures"] == 0
