"""What serving a batch costs the device, measured apart from the timed replay.

Counting ops (a TorchDispatchMode) and profiling slow serving down, so they never run inside a
timed pass. A probe replays the start of the stream on a session of its own: warm-up visits,
then `PROBE_BATCHES` batches to warm kernels, caches and graphs; it counts the ops of the next
`PROBE_BATCHES` batches and, on CUDA, profiles the ones after.

    costs = probe(lambda: InferenceSession(model, dataset, kv_cache=cache), warmup, batches, device)
    costs.ops_per_batch, costs.sync_ops_per_batch, costs.gpu_busy
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from benchmark.device_profile import OpCounts, gpu_busy_fraction
from model.inference import InferenceSession

PROBE_BATCHES = 3


@dataclass(frozen=True)
class ServingCost:
    ops_per_batch: float  # aten ops: the CPU proxy for kernel launches
    kernel_ops_per_batch: float  # of which run a kernel (views excluded)
    sync_ops_per_batch: float  # of which make the host wait for the device
    gpu_busy: float | None  # CUDA: kernel time / wall time while serving
    batches_counted: int


def probed_batches(batches: list[np.ndarray]) -> list[np.ndarray]:
    """The batches a probe serves (its warm-up visits should cover their users)."""
    return batches[: 3 * PROBE_BATCHES]


def probe(make_session: Callable[[], InferenceSession], warmup: list[np.ndarray], batches: list[np.ndarray],
          device: torch.device, close: Callable[[], None] = lambda: None) -> ServingCost | None:
    """Serve warmup + batches[:P], count ops over batches[P:2P], profile batches[2P:3P] (CUDA).

    None when there are too few batches to count any. `close` releases what `make_session` built.
    """
    session = make_session()
    try:
        for batch in warmup + batches[:PROBE_BATCHES]:
            session.serve(batch)
        counted = batches[PROBE_BATCHES : 2 * PROBE_BATCHES]
        if not counted:
            return None
        counts = [OpCounts.of(lambda b=b: session.serve(b)) for b in counted]
        profiled = batches[2 * PROBE_BATCHES : 3 * PROBE_BATCHES]
        busy = None
        if device.type == "cuda" and len(profiled) >= 2:  # one warms the profiler, the rest are measured
            remaining = iter(profiled)
            busy = gpu_busy_fraction(lambda: session.serve(next(remaining)), device, iterations=len(profiled) - 1)
        return ServingCost(
            ops_per_batch=float(np.mean([c.ops for c in counts])),
            kernel_ops_per_batch=float(np.mean([c.kernels for c in counts])),
            sync_ops_per_batch=float(np.mean([c.syncs for c in counts])),
            gpu_busy=busy,
            batches_counted=len(counts),
        )
    finally:
        close()
