"""CUDA graphs of the forward: one per bucket shape, replayed from static device buffers.

A served batch costs its host planning, one upload, and then a few hundred kernel launches;
replaying a captured graph turns those launches into one. `HSTURecommender.run_padded` is
capturable because a bucketed batch (`prepare_inputs(..., bucketed=True)`) has fixed shapes,
every array it reads lives in one device buffer, and nothing in it reads the device back.

    graphs = CUDAGraphs(model)
    inputs = model.prepare_inputs(batch, kv, bucketed=True)
    logits = graphs.run(inputs, kv)     # == model.run(inputs, kv)

The first batch of a bucket captures its graph (after warm-up runs on a side stream, which
also compile the Triton kernels); later batches copy their buffer into the graph's static
buffer and replay. The K/V pool the graph appends to is part of the key: a graph captured
for one cache is never replayed against another. Graphs share one memory pool.

A graph reads the weights at the addresses they had at its capture: weights copied in place
(`load_state_dict`) are replayed with their new values, but replaced ones (a new Parameter, `.to()`
another dtype) would leave it reading freed memory, so every run first compares where the weights
live with the captures' (`GraphTable`) and drops every graph when they moved. A capture is safe
beside the async offload worker: it is captured in thread-local mode (the worker's CUDA calls on its
own streams neither break it nor are refused), and it never waits on onload events (the session makes
the replay's stream wait for this batch's onloads before the next batch's prefetch is issued).

Whether a session uses graphs: `use_cuda_graphs` (on by default on CUDA with a backend that captures).
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

from model.attention import AttentionBackend
from model.kv_store import FullRecompute, KVStore
from model.recommender import HSTURecommender, ModelInputs

WARMUP_RUNS = 2
Entry = TypeVar("Entry")


def use_cuda_graphs(requested: bool | None, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether a session on `device` with `backend` serves through CUDA graphs. `requested` None (the
    default): wherever they can run, on CUDA with a backend that captures in graphs. True where they
    cannot is refused (ValueError), so a flag is never silently ignored."""
    possible = device.type == "cuda" and backend.captures_in_graphs
    if requested is None:
        return possible
    if requested and not possible:
        why = (f"the device is {device}" if device.type != "cuda" else
               f"the {backend.name!r} attention backend does not capture in graphs (is triton installed?)")
        raise ValueError(f"CUDA graphs need a CUDA device and an attention backend that captures in them: {why}")
    return requested


def weights_signature(model: nn.Module) -> tuple:
    """Where and how every parameter and buffer is stored: what a captured graph has baked in."""
    return tuple((t.data_ptr(), t.dtype) for _, t in itertools.chain(model.named_parameters(), model.named_buffers()))


def graph_key(inputs: ModelInputs, kv: KVStore) -> tuple:
    """What one captured graph replays: the bucket's shapes, the layout of its one upload, the pool it writes."""
    return inputs.features.shape, inputs.device_inputs.layout, kv.graph_key


class GraphTable(Generic[Entry]):
    """Captured entries by key, valid while the model's weights stay where their captures read them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._entries: dict[Hashable, Entry] = {}
        self._weights = weights_signature(model)
        self.invalidations = 0  # times every entry was dropped because the weights moved

    def get(self, key: Hashable) -> Entry | None:
        """The entry captured for `key`, None when there is none or the weights moved since (all are dropped)."""
        weights = weights_signature(self.model)
        if weights != self._weights:
            if self._entries:
                self.invalidations += 1
            self._entries.clear()
            self._weights = weights
        return self._entries.get(key)

    def put(self, key: Hashable, entry: Entry) -> None:
        self._entries[key] = entry

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_buffer: Tensor  # the inputs' flat device buffer the graph reads
    output: Tensor  # [candidate_rows, num_tasks], rewritten by every replay


class CUDAGraphs:
    def __init__(self, model: HSTURecommender) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {model.device}")
        self.model = model
        self._graphs: GraphTable[_Graph] = GraphTable(model)
        self._pool = None
        self.captures = 0
        self.replays = 0

    @property
    def invalidations(self) -> int:
        return self._graphs.invalidations

    def run(self, inputs: ModelInputs, kv: KVStore | None = None) -> Tensor:
        """`model.run(inputs, kv)` through the bucket's graph. -> [M, num_tasks] (a fresh tensor)"""
        if inputs.device_inputs.buffer is None:
            raise ValueError("inputs were not uploaded to a CUDA device")
        backend = inputs.attention.backend
        if not backend.captures_in_graphs:
            raise ValueError(f"CUDA graphs need an attention backend that captures in graphs, not {backend.name!r} "
                             "(the triton backend does: is triton installed?)")
        kv = kv if kv is not None else FullRecompute(inputs.attention.plan.batch.num_users)
        key = graph_key(inputs, kv)
        entry = self._graphs.get(key)
        if entry is None:
            if not len(self._graphs):  # none yet, or all dropped: their pool goes with them
                self._pool = None
            entry = self._capture(inputs, kv)
            self._graphs.put(key, entry)
        else:
            entry.static_buffer.copy_(inputs.device_inputs.buffer, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.output[: inputs.num_candidates].clone()

    def _capture(self, inputs: ModelInputs, kv: KVStore) -> _Graph:
        static_buffer = inputs.device_inputs.buffer.clone()
        static_inputs = inputs.rebound(static_buffer)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.model.run_padded(static_inputs, kv)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: the async offload worker keeps issuing copies on its own streams meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self.model.run_padded(static_inputs, kv)
        self._pool = graph.pool()
        self.captures += 1
        return _Graph(graph, static_buffer, output)
