"""What an offload writes (`plan_offload`), and the host buffer that batches offloads (`OffloadStaging`).

An offload writes what the host tier lacks of a user's committed device pages: incrementally, on
top of the entry this manager wrote or onloaded (`synced`) only, since a shared tier may hold a
same-start entry of another history (another node), whose pages must not be kept; and nothing
when a shared tier holds an entry of another writer that reaches further into the user's history
(another node served the user since: the device copy is a stale prefix of it).

Offloaded one user at a time, a batch of users costs a gather, the device-to-host copies and a
host wait per user. Offloads that happen together (the users of a served batch, the victims of one
eviction) instead gather all their pages with one `DevicePagePool.copy_out` (one gather, one copy
per layer, one wait) into this buffer, and each user's tier write then copies its pages from host
memory. The buffer is layer-major (the pool's gather copies each layer in one transfer), pinned
(asynchronous DMA) when asked, reused, and grown by doubling.

On the CPU the pool's pages are host memory already: the residency leaves staging off there, and
each tier write reads its user's pages straight from the pool (`KVCacheConfig.stage_offloads`).
"""
from __future__ import annotations

from array import array
from typing import NamedTuple

import torch

from .page_data import PageData
from .page_layout import PageLayout
from .read_window import ReadWindow
from .resident import Resident
from .storage import HostEntry


class OffloadWrite(NamedTuple):
    user_id: int
    resident: Resident
    first_page: int
    pages: array  # the device pages of the user's pages [first_page, num_pages)


def plan_offload(user_id: int, res: Resident, held: HostEntry | None, layout: PageLayout,
                 compact: ReadWindow | None = None) -> OffloadWrite | str:
    """What the host (holding `held`) lacks of the user's committed device data `res`, or why nothing is
    written: "synced" (the host holds it; `res.synced` is set) or "superseded". With `compact`, an
    incremental write starts early enough to rewrite the pages whose tokens went unread since they
    were written (`ReadWindow.compact_from`)."""
    ours = HostEntry(res.start_pos, res.length, res.tag)
    if held == ours:
        res.synced = ours
        return "synced"
    if held is not None and held != res.synced and held.start_pos + held.length > res.start_pos + res.length:
        return "superseded"
    num_pages = layout.num_pages(res.length)
    if held is not None and held == res.synced:
        # Rewrite the partial last page, then the new ones (the last page alone for a new tag).
        first = min(held.length // layout.page_size, num_pages - 1)
        if compact is not None:
            first = compact.compact_from(res.length, res.zeroed_end, first, layout.page_size)
    else:
        first = 0
    return OffloadWrite(user_id, res, first, res.pages[first:num_pages])


class OffloadStaging:
    def __init__(self, layout: PageLayout, pinned: bool) -> None:
        self.layout = layout
        self.pinned = pinned
        self._kv: torch.Tensor | None = None  # [num_layers, capacity, 2, S, H, D]
        self._times: torch.Tensor | None = None  # [capacity, S]

    @property
    def capacity(self) -> int:
        return 0 if self._times is None else self._times.shape[0]

    def take(self, n: int) -> PageData:
        """`n` pages (as `[n, num_layers, 2, S, H, D]` layer-major views), valid until the next `take`."""
        if n > self.capacity:
            lay, pages = self.layout, max(n, 2 * self.capacity)
            with torch.inference_mode(False):  # written again by calls made outside inference mode
                self._kv = torch.empty((lay.num_layers, pages, *lay.page_shape[1:]), dtype=lay.dtype,
                                       pin_memory=self.pinned)
                self._times = torch.empty((pages, lay.page_size), dtype=torch.int64, pin_memory=self.pinned)
        return PageData(self._kv[:, :n].transpose(0, 1), self._times[:n])
