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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.kv_store import FullRecompute, KVStore
from model.recommender import HSTURecommender, ModelInputs

WARMUP_RUNS = 2


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
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self.captures = 0
        self.replays = 0

    def run(self, inputs: ModelInputs, kv: KVStore | None = None) -> Tensor:
        """`model.run(inputs, kv)` through the bucket's graph. -> [M, num_tasks] (a fresh tensor)"""
        if inputs.device_inputs.buffer is None:
            raise ValueError("inputs were not uploaded to a CUDA device")
        backend = inputs.attention.backend
        if not backend.captures_in_graphs:
            raise ValueError(f"CUDA graphs need an attention backend that captures in graphs, not {backend.name!r} "
                             "(the triton backend does: is triton installed?)")
        kv = kv if kv is not None else FullRecompute(inputs.attention.plan.batch.num_users)
        key = (inputs.features.shape, inputs.device_inputs.layout, kv.graph_key)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(inputs, kv)
        else:
            entry.static_buffer.copy_(inputs.device_inputs.buffer, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.output[: inputs.num_candidates].clone()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

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
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.model.run_padded(static_inputs, kv)
        self._pool = graph.pool()
        self.captures += 1
        return _Graph(graph, static_buffer, output)
