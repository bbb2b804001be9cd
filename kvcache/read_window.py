"""ReadWindow: the cached tokens a model can still read, and what offloads do with the others.

A model with sliding-window attention (each query sees the `size` keys before its own end, and the
`sink` first tokens of its window, model/attention/base.py `KeyWindow`) never reads a cached token
again once `size` tokens follow it: every later query of the user ends at or after the cached
length L, so it reads tokens `[L - size, L)` and the sink, never `[sink, L - size)`. A user with a
long history therefore caches mostly K/V no query will read (docs/kvcache.md, "What a windowed
model never reads again").

With `KVCacheConfig.read_window` set, the device pages that hold unread tokens only are freed
(`unread_pages`: at commit, and not allocated on an onload): the user's page table points them at
the pool's sink page, which attention reads only under its window's mask. What leaves the device
holds zeros for the unread tokens' K/V and times (`zero_unread`; a released page's came from the
sink): exact for the model (a key it never reads may hold anything), and a page of zeros costs a compressing codec (`zstd`,
`zstd-channel`) next to nothing. Offloads are incremental (the host keeps the pages it has and receives the
new ones), so tokens that fall out of the window after their page was written stay stored as they
were until the lag is worth a rewrite: `compact_from` moves the write's first page back to the
first such page once they number `size` tokens, which bounds both the stored lag and the extra
writing (each token is written at most about twice).

Only the model whose window this is may read the entries: its fingerprint names the window
(model/cache_tag.py), so a model with a wider one never reuses them.

>>> window = ReadWindow(size=4, sink=1)
>>> window.unread_end(10)  # tokens [1, 6) are never read again; 0 and [6, 10) are
6
>>> window.unread_end(3)
1
>>> window.unread_pages(30, page_size=2)  # pages 1..12 hold tokens 2..25 only: unread
(1, 13)
"""
from __future__ import annotations

from dataclasses import dataclass

from .page_data import PageData


@dataclass(frozen=True)
class ReadWindow:
    size: int  # the last tokens of an entry a later query may read
    sink: int = 0  # the entry's first tokens, read by every query

    def __post_init__(self) -> None:
        for name, least in (("size", 1), ("sink", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ReadWindow.{name} must be an int >= {least}, got {value!r}.")

    def unread_end(self, length: int) -> int:
        """The end of the tokens `[sink, end)` of a `length`-token entry that no later query reads."""
        return max(self.sink, length - self.size)

    def unread_pages(self, length: int, page_size: int) -> tuple[int, int]:
        """Pages `[first, stop)` of a `length`-token entry that hold unread tokens only (first == stop: none)."""
        first = -(-self.sink // page_size)
        return first, max(first, self.unread_end(length) // page_size)

    def compact_from(self, length: int, zeroed_end: int, first_page: int, page_size: int) -> int:
        """The first page an offload of a `length`-token entry writes, given that the host's copy holds
        zeros up to `zeroed_end` and the incremental write would start at `first_page`: moved back to
        the page holding `zeroed_end` once `size` more tokens went unread."""
        zeroed_end = max(zeroed_end, self.sink)
        if self.unread_end(length) - zeroed_end >= self.size:
            return min(first_page, zeroed_end // page_size)
        return first_page


def zero_unread(pages: PageData, first_page: int, unread: tuple[int, int], page_size: int) -> None:
    """Zero the K/V and times of entry tokens `unread = [lo, hi)` held by `pages`, the entry's pages
    from `first_page` on (at most three slice writes of each)."""
    base = first_page * page_size
    lo, hi = max(unread[0] - base, 0), min(unread[1] - base, pages.num_pages * page_size)
    if lo >= hi:
        return
    (p0, s0), (p1, s1) = divmod(lo, page_size), divmod(hi, page_size)
    for data, token_dim in ((pages.kv, 3), (pages.times, 1)):  # [k, L, 2, S, H, D], [k, S]
        head = (slice(None),) * (token_dim - 1)
        if p0 == p1:
            data[(p0, *head, slice(s0, s1))].zero_()
            continue
        data[(p0, *head, slice(s0, None))].zero_()
        data[p0 + 1 : p1].zero_()
        if s1:
            data[(p1, *head, slice(None, s1))].zero_()
