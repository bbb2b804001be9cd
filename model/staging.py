"""One host-to-device copy per batch: a batch's host arrays packed into a pooled pinned buffer.

Everything a forward needs on the device (sparse ids, token rows, attention extents, page
tables, slots) is planned on the host with numpy. `DeviceStaging.upload` packs those arrays
into one reusable pinned buffer (8-byte aligned segments), issues one non-blocking copy, and
hands back typed views of the device copy. The host buffers are a small ring: a buffer is
refilled only after the copy that last read it has finished (an event per buffer), so packing
batch i+1 overlaps the copy and compute of batch i, and no pinned memory is allocated once
the ring has grown to the largest batch. On CPU the arrays are used in place (no copy).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

_ALIGN = 8  # bytes: every segment can be viewed as int64 / float64
_RING = 2


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class DeviceStaging:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: list[Tensor | None] = [None] * _RING
        self._copied: list[torch.cuda.Event | None] = [None] * _RING
        self._next = 0
        self.pinned_allocations = 0  # grows only while the ring adapts to a larger batch

    def upload(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """{name: host array} -> {name: tensor of the same dtype and shape on the device}."""
        if self.device.type == "cpu":
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        layout, total = [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            layout.append((name, a, total))
            total += _aligned(a.nbytes)
        slot = self._next
        self._next = (slot + 1) % _RING
        host = self._host_buffer(slot, max(total, _ALIGN))
        packed = host.numpy()
        for _, a, offset in layout:
            packed[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        device = host[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied[slot] = event
        out = {}
        for name, a, offset in layout:
            segment = device[offset : offset + a.nbytes].view(_TORCH_DTYPES[a.dtype.str])
            out[name] = segment.view(a.shape)
        return out

    def _host_buffer(self, slot: int, nbytes: int) -> Tensor:
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # the copy that last read this buffer is done
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            capacity = max(nbytes, 2 * (0 if buf is None else buf.numel()), 1 << 16)
            buf = self._buffers[slot] = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            self.pinned_allocations += 1
        return buf


_TORCH_DTYPES = {
    np.dtype(np.int64).str: torch.int64,
    np.dtype(np.int32).str: torch.int32,
    np.dtype(np.float32).str: torch.float32,
    np.dtype(np.bool_).str: torch.bool,
}
