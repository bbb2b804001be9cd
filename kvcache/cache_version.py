"""What a caller planned a prepare against, so that a prepare can tell whether it still holds.

Lengths alone cannot: another caller may invalidate a user and commit other tokens of the same
length in between, and a prepare checked by length would continue data it never planned on. A
`CacheVersion` names the cached tokens themselves: their range, the caller's tag (its digest of
the events behind them), and the generation of the local commit that produced them.

Generations come from one counter per manager and are given at every commit. Tokens the manager
holds as a host tier reported them (onloaded, prefetched, or evicted back to the host) have
generation 0: the host entry's (start, length, tag) names them, as it does for every node.
"""
from __future__ import annotations

from typing import NamedTuple

from .errors import KVCacheStaleError

FROM_HOST = 0  # the generation of tokens named by their host entry alone


class CacheVersion(NamedTuple):
    start_pos: int
    length: int  # 0: nothing cached
    tag: bytes
    generation: int


NOTHING = CacheVersion(0, 0, b"", FROM_HOST)


class Residence(NamedTuple):
    """Where a user's cached tokens are, from one lookup: what a visit is planned against (`version`)
    and what reports where its reused K/V came from. Host entries are (start_pos, length)."""

    version: CacheVersion  # the reusable tokens, as get_user_versions reports them
    on_device: bool  # `version` is the device's committed tokens
    own_host: tuple[int, int] | None  # what this manager's own host tiers hold (memory, disk); None: nothing
    best_host: tuple[int, int] | None  # the best entry of any host tier, a shared one included


def check_version(u: int, expected: CacheVersion, current: CacheVersion) -> None:
    """KVCacheStaleError unless the user's cached tokens are still the ones the caller planned against."""
    if not isinstance(expected, CacheVersion):
        raise TypeError(f"expected_versions must hold CacheVersion values (get_user_versions), got {expected!r:.80}")
    if expected == current:
        return
    if expected[:3] == current[:3]:
        what = f"rewritten with the same range and tag (generation {expected.generation} -> {current.generation})"
    else:
        what = (f"{expected.length} tokens from {expected.start_pos} (tag {expected.tag.hex()[:16]!r}) are now "
                f"{current.length} tokens from {current.start_pos} (tag {current.tag.hex()[:16]!r})")
    raise KVCacheStaleError(
        f"User {u}: the cached tokens changed since they were planned against: {what}; "
        "call get_user_versions again and re-plan."
    )
