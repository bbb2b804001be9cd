"""The cache's bookkeeping invariants, asserted on demand (tests, debugging; O(pages))."""
from __future__ import annotations

from .residency import Residency


def check_invariants(residency: Residency) -> None:
    """Assert that pages, residents, the policy and what was synced to the host tier agree (the manager's lock held).

    Every page is owned once or free; every resident user is in the policy; a user in flight
    holds at least its committed pages, any other exactly them; what this manager last wrote to
    or read from its tiers for a user is never ahead of the device. (A tier shared with other
    nodes may hold more of the user: another node served it meanwhile. That is a stale device
    copy, not broken bookkeeping.)
    """
    lay, pool, users, in_flight = residency.layout, residency.pool, residency.users, residency.in_flight
    sink = pool.num_pages  # released pages (kvcache/read_window.py) point there
    owned = [p for res in users.values() for p in res.pages if p != sink]
    free = pool.free_pages()
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert not set(owned) & set(free), "a page is both owned and free"
    assert len(owned) + len(free) == pool.num_pages == pool.num_used + pool.num_free, "pages leaked"
    assert len(residency.policy) == len(users), "policy and residents disagree"
    assert in_flight <= users.keys(), "an in-flight user is not resident"
    for u, res in users.items():
        committed = lay.num_pages(res.length)
        if u in in_flight:
            assert len(res.pages) >= committed, f"user {u} lost pages"
        else:
            assert res.length > 0 and len(res.pages) == committed, f"user {u} holds wrong pages"
        released = [i for i, p in enumerate(res.pages) if p == sink]
        first, stop = residency.release.released(res.length)
        assert released == list(range(first, stop)), f"user {u}: released pages {released}, expected [{first}, {stop})"
        h = res.synced
        assert h is None or (h.start_pos == res.start_pos and h.length <= res.length), f"user {u}: host ahead"
