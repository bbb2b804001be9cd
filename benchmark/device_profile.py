"""What a served batch costs the device, beyond its wall time: aten ops (CPU proxy for launches),
on CUDA the fraction of wall time the GPU was busy running kernels (torch profiler), and the peak
memory it allocates; `sync` makes a host timer time device work."""
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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host timer around `fn` times the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes `fn` allocated on `device` above what was allocated when it started.

    CUDA: the caching allocator's peak statistics. CPU has none, so the torch profiler records every
    allocation and free (`profile_memory`) and the peak of their running sum is taken: what torch
    allocated, not the process's resident memory. The profiler slows `fn`: never time under it.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()  # > 0 an allocation, < 0 a free
        peak = max(peak, current)
    return peak
