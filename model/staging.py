"""One host-to-device copy per batch: a batch's host arrays packed into a pooled pinned buffer.

Everything a forward needs on the device (sparse ids, token rows, attention extents, page
tables, slots) is planned on the host with numpy. `DeviceStaging.upload` packs those arrays
into one reusable pinned buffer (16-byte aligned segments), issues one non-blocking copy, and
hands back typed views of the device copy. The host buffers are a small ring: a buffer is
refilled only after the copy that last read it has finished (an event per buffer), so packing
batch i+1 overlaps the copy and compute of batch i, and no pinned memory is allocated once
the ring has grown to the largest batch. On CPU the arrays are used in place (no copy).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Bytes: every segment can be viewed as int64 / float64, and every one is 16-byte aligned. Triton
# compiles a kernel variant per combination of its pointers' 16-divisibility: segments aligned by
# whatever sizes the batch's earlier arrays had would compile new variants while serving.
_ALIGN = 16
_RING = 2


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # bytes into the packed buffer
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DeviceArrays(Mapping):
    """A batch's arrays on the device: `tensors` are views of one flat `buffer` (None on CPU)."""

    tensors: dict[str, Tensor]
    buffer: Tensor | None
    layout: tuple[Segment, ...]

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def rebound(self, buffer: Tensor) -> DeviceArrays:
        """The same arrays viewed in another buffer of the same layout (a CUDA graph's static copy)."""
        return DeviceArrays(_views(buffer, self.layout), buffer, self.layout)


def _views(buffer: Tensor, layout: tuple[Segment, ...]) -> dict[str, Tensor]:
    out = {}
    for seg in layout:
        nbytes = int(np.prod(seg.shape, dtype=np.int64)) * seg.dtype.itemsize
        out[seg.name] = buffer[seg.offset : seg.offset + nbytes].view(seg.dtype).view(seg.shape)
    return out


def pack_layout(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[Segment, ...], int]:
    """Where each array sits in the packed buffer, in order, each at an _ALIGN-aligned offset -> (layout, bytes)."""
    layout, total = [], 0
    for name, a in arrays.items():
        layout.append(Segment(name, total, _TORCH_DTYPES[a.dtype.str], a.shape))
        total += _aligned(a.nbytes)
    return tuple(layout), total


class DeviceStaging:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: list[Tensor | None] = [None] * _RING
        self._copied: list[torch.cuda.Event | None] = [None] * _RING
        self._next = 0
        self.pinned_allocations = 0  # grows only while the ring adapts to a larger batch

    def upload(self, arrays: Mapping[str, np.ndarray]) -> DeviceArrays:
        """{name: host array} -> the same arrays on the device (same dtypes and shapes), in one copy."""
        if self.device.type == "cpu":
            tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
            return DeviceArrays(tensors, None, ())
        packed_arrays = [np.ascontiguousarray(a) for a in arrays.values()]
        layout, total = pack_layout(dict(zip(arrays, packed_arrays)))
        slot = self._next
        self._next = (slot + 1) % _RING
        host = self._host_buffer(slot, max(total, _ALIGN))
        packed = host.numpy()
        for seg, a in zip(layout, packed_arrays):
            packed[seg.offset : seg.offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        device = host[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied[slot] = event
        return DeviceArrays(_views(device, layout), device, layout)

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
