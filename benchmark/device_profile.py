"""What a served batch costs the device, beyond its wall time: aten ops (CPU proxy for launches),
and on CUDA the fraction of wall time the GPU was busy running kernels (torch profiler)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.op_counter import OpCounter


@dataclass(frozen=True)
class OpCounts:
    ops: int  # aten ops dispatched
    kernels: int  # of which run a kernel (views excluded)
    syncs: int  # of which make the host wait for the device

    @classmethod
    def of(cls, fn: Callable[[], object]) -> OpCounts:
        with OpCounter() as counter:
            fn()
        return cls(counter.total, counter.kernels, sum(counter.syncs.values()))


def gpu_busy_fraction(fn: Callable[[], object], device: torch.device, iterations: int = 5) -> float | None:
    """Sum of CUDA kernel time over wall time while `fn` runs `iterations` times (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    return min(1.0, kernel_us / wall_us) if wall_us else None
