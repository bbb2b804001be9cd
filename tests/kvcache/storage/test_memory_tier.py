"""InMemoryHostStorage against the HostKVStorage contract, and the eviction policies."""
import pytest
import torch

from helpers import TINY_LAYOUT_ARGS, host_pages, pages_equal
from kvcache import HostEntry, InMemoryHostStorage, LFUPolicy, LRUPolicy, PageLayout
from kvcache.page_data import concat_pages

LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)
PAGE = LAYOUT.page_nbytes  # 2 * 2 * 4 * 1 * 2 * 4 = 128 bytes


def _pages(n, value):
    return host_pages(LAYOUT, n, value)


def _fill(pages):
    return lambda dst: dst.copy_(pages)


def _store(capacity_pages):
    s = InMemoryHostStorage(capacity_pages * PAGE)
    s.bind(LAYOUT)
    return s


def test_write_read_incremental_rewrites_last_partial_page():
    s = _store(16)
    assert s.write(7, 10, 6, 0, _fill(_pages(2, 1))).stored  # tokens [10, 16): pages 0, 1 (partial)
    assert s.info(7) == HostEntry(10, 6)
    new = _pages(2, 2)
    assert s.write(7, 10, 12, 1, _fill(new)).stored  # page 1 rewritten, page 2 new
    hp = s.read(7)
    assert (hp.start_pos, hp.length) == (10, 12)
    assert pages_equal(hp.pages, concat_pages([_pages(1, 1), new]))


def test_write_from_page_zero_replaces_the_entry():
    s = _store(16)
    s.write(7, 0, 8, 0, _fill(_pages(2, 1)))
    s.write(7, 5, 3, 0, _fill(_pages(1, 3)))
    hp = s.read(7)
    assert (hp.start_pos, hp.length) == (5, 3) and pages_equal(hp.pages, _pages(1, 3))


@pytest.mark.parametrize(
    "setup, args",
    [
        (None, (1, 0, 8, 1)),  # nothing stored, writing from page 1
        ((0, 4), (5, 0, 12, 2)),  # holds one page, writing from page 2
        ((0, 4), (3, 0, 8, 1)),  # another start
        ((0, 4), (0, 0, 0, 0)),  # empty write
        ((0, 4), (0, 0, 8, 2)),  # first_page past the end
    ],
)
def test_write_refuses_gaps_and_bad_ranges(setup, args):
    s = _store(16)
    if setup:
        s.write(7, setup[0], setup[1], 0, _fill(_pages(1, 1)))
    start, _, length, first = args[0], args[1], args[2], args[3]
    with pytest.raises(ValueError):
        s.write(7, start, length, first, _fill(_pages(max(LAYOUT.num_pages(length) - first, 0), 2)))


def test_lru_eviction_spares_the_writer_and_reports_what_it_dropped():
    s = _store(4)
    for u in (1, 2, 3):
        s.write(u, 0, 4, 0, _fill(_pages(1, u)))
    s.read(1)  # 1 becomes most recently used: 2 is now least recently used
    result = s.write(3, 0, 12, 1, _fill(_pages(2, 9)))  # 3 grows to 3 pages: needs 1 more than free
    assert result.stored and [u for u, _ in result.evicted] == [2]
    assert dict(result.evicted)[2] == HostEntry(0, 4)
    assert s.info(2) is None and s.info(1) == HostEntry(0, 4) and s.info(3) == HostEntry(0, 12)
    assert s.bytes_used <= s.capacity_bytes


def test_user_larger_than_the_tier_is_not_stored_and_nothing_changes():
    s = _store(2)
    s.write(1, 0, 4, 0, _fill(_pages(1, 1)))
    s.write(2, 0, 4, 0, _fill(_pages(1, 2)))
    result = s.write(2, 0, 12, 1, _fill(_pages(2, 5)))
    assert not result.stored and result.evicted == ()
    assert s.info(1) == HostEntry(0, 4) and s.info(2) == HostEntry(0, 4)
    assert pages_equal(s.read(2).pages, _pages(1, 2))


def test_growth_is_geometric_when_there_is_room_and_exact_otherwise():
    s = _store(64)
    s.write(1, 0, 4, 0, _fill(_pages(1, 1)))
    for n in range(2, 9):
        s.write(1, 0, 4 * n, n - 1, _fill(_pages(1, n)))
    assert s.bytes_used == 8 * PAGE  # capacities 1, 2, 4, 8
    assert torch.equal(s.read(1).pages.kv[:, 0, 0, 0, 0, 0], torch.arange(1, 9, dtype=torch.float32))
    tight = _store(3)
    tight.write(1, 0, 8, 0, _fill(_pages(2, 1)))
    tight.write(1, 0, 12, 2, _fill(_pages(1, 2)))  # doubling to 4 pages would not fit: exact 3
    assert tight.bytes_used == 3 * PAGE


def test_failed_fill_drops_the_user():
    s = _store(8)
    s.write(1, 0, 6, 0, _fill(_pages(2, 1)))

    def broken(dst):
        dst.kv.fill_(-1)
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        s.write(1, 0, 8, 1, broken)
    assert s.info(1) is None and s.bytes_used == 0


def test_drop_and_bind():
    s = _store(8)
    s.write(1, 0, 4, 0, _fill(_pages(1, 1)))
    assert s.drop(1) and not s.drop(1) and s.num_users == 0 and s.bytes_used == 0
    s.bind(LAYOUT)  # same layout again is fine
    with pytest.raises(ValueError, match="cannot rebind"):
        s.bind(PageLayout(2, 1, 2, 8, torch.float32))
    with pytest.raises(RuntimeError, match="not bound"):
        InMemoryHostStorage(1024).write(1, 0, 4, 0, _fill(_pages(1, 1)))


def test_lru_policy_order():
    p = LRUPolicy()
    for u in (1, 2, 3):
        p.add(u)
    p.touch(1)
    p.remove(2)
    assert list(p.order()) == [3, 1] and len(p) == 2


def test_lfu_policy_order_breaks_ties_by_recency():
    p = LFUPolicy()
    for u in (1, 2, 3, 4):
        p.add(u)
    p.touch(3)
    p.touch(3)
    p.touch(1)
    p.touch(2)
    assert list(p.order()) == [4, 1, 2, 3]
    p.remove(4)
    p.remove(3)
    assert list(p.order()) == [1, 2] and len(p) == 2


def test_pages_live_in_one_slab_allocated_once_and_reused():
    s = _store(8)
    assert s.slab.allocations == 1 and s.slab.kv.shape[0] == 8
    s.write(1, 0, 16, 0, _fill(_pages(4, 1)))
    ptr = s.read(1).pages.kv.data_ptr()
    s.drop(1)
    assert s.bytes_used == 0
    s.write(2, 0, 13, 0, _fill(_pages(4, 2)))  # the freed range comes back
    assert s.read(2).pages.kv.data_ptr() == ptr and pages_equal(s.read(2).pages, _pages(4, 2))
    s.drop(2)
    s.write(3, 0, 32, 0, _fill(_pages(8, 3)))  # the whole slab, once the freed ranges coalesced
    assert s.bytes_used == 8 * PAGE and s.num_users == 1
    for u in range(50):  # churn: evictions and growth never allocate
        s.write(u % 7, 0, 4 * (1 + u % 3), 0, _fill(_pages(1 + u % 3, u)))
    assert s.slab.allocations == 1 and s.bytes_used <= s.capacity_bytes


def test_a_grown_user_keeps_its_pages_when_the_free_room_is_fragmented():
    s = _store(4)
    for u in (1, 2, 3):
        s.write(u, 0, 4, 0, _fill(_pages(1, u)))  # slab: [1][2][3][free]
    s.read(1)
    s.read(3)
    # 2 grows to 2 contiguous pages: two pages are free, but apart, so the least recently used goes
    result = s.write(2, 0, 8, 1, _fill(_pages(1, 9)))
    assert result.stored and [u for u, _ in result.evicted] == [1]
    assert pages_equal(s.read(2).pages, concat_pages([_pages(1, 2), _pages(1, 9)]))
    assert pages_equal(s.read(3).pages, _pages(1, 3))


def test_no_contiguous_room_beside_protected_users_leaves_the_writer_unchanged():
    s = _store(4)
    for u in (1, 2, 3):
        s.write(u, 0, 4, 0, _fill(_pages(1, u)))  # slab: [1][2][3][free]
    s.drop(2)  # [1][free][3][free]: two pages free, none adjacent
    s.write(4, 0, 4, 0, _fill(_pages(1, 4)))  # takes the first free page
    s.drop(4)
    result = s.write(3, 0, 8, 1, _fill(_pages(1, 8)), protect=[1])  # 2 pages: fits only if 3 moves
    assert result.stored and s.info(3) == HostEntry(0, 8) and s.info(1) == HostEntry(0, 4)
    s = _store(3)
    for u in (1, 2, 3):
        s.write(u, 0, 4, 0, _fill(_pages(1, u)))  # [1][2][3]
    s.drop(1)
    s.drop(3)  # [free][2][free]: two free pages that are not contiguous, 2 protected
    result = s.write(5, 0, 8, 0, _fill(_pages(2, 5)), protect=[2])
    assert not result.stored and result.evicted == () and s.info(5) is None
    assert pages_equal(s.read(2).pages, _pages(1, 2)) and s.bytes_used == PAGE


def test_protected_users_are_never_evicted():
    s = _store(4)
    s.write(1, 0, 8, 0, _fill(_pages(2, 1)))
    s.write(2, 0, 4, 0, _fill(_pages(1, 2)))
    result = s.write(3, 0, 8, 0, _fill(_pages(2, 3)), protect=[1])  # needs 1 more page: evicts 2, not 1
    assert result.stored and [u for u, _ in result.evicted] == [2]
    result = s.write(4, 0, 12, 0, _fill(_pages(3, 4)), protect=[1, 3])  # cannot fit beside 1 and 3
    assert not result.stored and result.evicted == ()
    assert s.info(1) == HostEntry(0, 8) and s.info(3) == HostEntry(0, 8) and s.info(4) is None
