"""CUDA graph replays score exactly like eager forwards (CUDA only; the bucketing itself is tested on
CPU in test_batch_shape.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, make_cache, sensitive_model
from model.config import config_for_dataset
from model.cuda_graphs import CUDAGraphs
from model.inference import InferenceSession


def test_graphs_are_refused_off_cuda():
    from helpers import tiny_config

    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device"):
        CUDAGraphs(sensitive_model(tiny_config()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "full"])
def test_graph_replays_equal_eager_forwards(tmp_path, cached):
    dataset = InferenceDataset(build_processed(tmp_path))
    cfg = config_for_dataset("tiny", dataset)
    model = sensitive_model(cfg, 0).to("cuda")

    def session(graphs: bool) -> InferenceSession:
        cache = make_cache(cfg, num_pages=2048, device="cuda") if cached else None
        return InferenceSession(model, dataset, kv_cache=cache, cuda_graphs=graphs)

    eager, graphed = session(False), session(True)
    batches = list(dataset.batches(dataset.request_indices(max_requests=120), 8))
    for batch in batches:
        assert_logits_close(graphed.serve(batch).logits, eager.serve(batch).logits)
    assert graphed.graphs.replays == len(batches)
    assert 1 <= graphed.graphs.captures < len(batches)  # batches share their buckets' graphs
    assert np.isfinite(graphed.serve(batches[0]).logits.numpy()).all()


# ---------------------------------------------------------------- what runs on CPU: the decisions around the graphs
def test_graphs_are_used_by_default_where_they_can_run_and_refused_where_they_cannot():
    from model.attention import BlockedAttention
    from model.cuda_graphs import use_cuda_graphs

    class Capturing(BlockedAttention):
        captures_in_graphs = True

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_cuda_graphs(None, cuda, Capturing()) is True  # the default on CUDA
    assert use_cuda_graphs(None, cuda, BlockedAttention()) is False  # a backend that cannot be captured
    assert use_cuda_graphs(None, cpu, Capturing()) is False
    assert use_cuda_graphs(False, cuda, Capturing()) is False  # --no-cuda_graphs
    with pytest.raises(ValueError, match="the device is cpu"):
        use_cuda_graphs(True, cpu, Capturing())
    with pytest.raises(ValueError, match="'blocked' attention backend does not capture"):
        use_cuda_graphs(True, cuda, BlockedAttention())


def test_graphs_are_dropped_when_the_weights_they_read_are_replaced():
    from helpers import tiny_config
    from model.cuda_graphs import GraphTable

    model = sensitive_model(tiny_config(), 0)
    table = GraphTable(model)
    table.put("bucket", "graph")
    model.load_state_dict(sensitive_model(tiny_config(), 1).state_dict())  # copied in place: same addresses
    assert table.get("bucket") == "graph" and table.invalidations == 0
    head = model.head[0]
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # a new tensor: the graph would read freed memory
    assert table.get("bucket") is None and len(table) == 0 and table.invalidations == 1
    table.put("bucket", "recaptured")
    assert table.get("bucket") == "recaptured"
    model.to(torch.float64)  # every weight moves
    assert table.get("bucket") is None and table.invalidations == 2


def test_batches_of_one_bucket_share_one_graph():
    from helpers import Visit, make_batch, random_candidates, random_histories, tiny_config
    from model.cuda_graphs import graph_key
    from model.kv_store import FullRecompute, PagedKV

    cfg = tiny_config()
    model = sensitive_model(cfg, 0)
    rng = np.random.default_rng(0)
    histories = random_histories(rng, 8, 40, cfg)

    def key(ends: dict[int, int]) -> tuple:
        batch = make_batch(histories, [Visit(u, e, random_candidates(rng, 3)) for u, e in ends.items()])
        return graph_key(model.prepare_inputs(batch, None, bucketed=True), FullRecompute(batch.batch_size))

    three, other_three = key({0: 20, 1: 25, 2: 22}), key({3: 21, 4: 24, 5: 23})
    assert three == other_three  # other users, lengths and candidates: the same bucket, one graph
    assert key({0: 20}) != three  # one user: a smaller bucket
    assert key({u: 40 for u in range(8)}) != three  # more rows than the bucket holds

    # Through a cache, the key names the cache whose pool the graph writes, without asking for its pages
    # (that would make the replay's stream wait for the onloads of the next batch's prefetch).
    cache = make_cache(cfg, num_pages=64)
    batch = make_batch(histories, [Visit(0, 20, random_candidates(rng, 3))])
    meta = cache.prepare_kv_cache([0], [0], [cfg.num_prefix_tokens + 20])
    kv = PagedKV(cache, meta)
    inputs = model.prepare_inputs(batch, kv, bucketed=True)
    asked = []
    cache.k_cache = cache.v_cache = lambda layer: asked.append(layer)
    paged = graph_key(inputs, kv)
    assert not asked and paged[-1] == ("paged", cache) and paged != key({0: 20})


def test_the_replay_waits_for_its_onloads_before_the_next_batchs_prefetch(tmp_path):
    """The order a graph replay needs (on CPU the waits are no-ops, so it is recorded): this batch's
    prepare (its onloads), the stream's wait for them, the next batch's prefetch, then the replay, which
    must not wait for what the prefetch issued. A stand-in runs the bucketed inputs eagerly in the graph's
    place, and scores like a session without graphs."""
    dataset = InferenceDataset(build_processed(tmp_path))
    cfg = config_for_dataset("tiny", dataset)
    model = sensitive_model(cfg, 0)
    calls: list[str] = []

    class EagerGraphs:  # CUDAGraphs.run's contract, without a device to capture on
        def run(self, inputs, kv):
            calls.append("replay")
            return model.run(inputs, kv)

    cache = make_cache(cfg, num_pages=2048)
    graphed = InferenceSession(model, dataset, kv_cache=cache)
    graphed.graphs = EagerGraphs()
    def spy(name: str):
        real = getattr(cache, name)

        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for name in ("prepare_kv_cache", "wait_for_onloads", "prefetch"):
        setattr(cache, name, spy(name))
    eager = InferenceSession(model, dataset, kv_cache=make_cache(cfg, num_pages=2048))
    batches = list(dataset.batches(dataset.request_indices(max_requests=48), 8))
    for batch, following in itertools.pairwise(batches):
        calls.clear()
        assert_logits_close(graphed.serve(batch, following).logits, eager.serve(batch, following).logits)
        assert calls == ["prepare_kv_cache", "wait_for_onloads", "prefetch", "replay"], calls


# ---------------------------------------------------------------- on CUDA: the graphs where serving happens
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_with_async_offload_and_prefetch_equal_eager(tmp_path):
    """Users offloaded by the worker after every visit and onloaded back (prefetched while the previous
    batch replays): captures happen while the worker copies, replays overlap the prefetch."""
    dataset = InferenceDataset(build_processed(tmp_path))
    cfg = config_for_dataset("tiny", dataset)
    model = sensitive_model(cfg, 0).to("cuda")

    def session(graphs: bool) -> InferenceSession:
        cache = make_cache(cfg, num_pages=512, device="cuda", async_offload=True)  # evicts: users come back from the host
        return InferenceSession(model, dataset, kv_cache=cache, cuda_graphs=graphs)

    eager, graphed = session(False), session(True)
    batches = list(dataset.batches(dataset.request_indices(max_requests=160), 8))
    for batch, following in zip(batches, [*batches[1:], None]):
        assert_logits_close(graphed.serve(batch, following).logits, eager.serve(batch, following).logits)
    assert graphed.kv_cache.stats().prefetched_users > 0 and graphed.kv_cache.stats().tokens_reused > 0
    assert graphed.graphs.replays == len(batches) and graphed.graphs.captures < len(batches)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replaced_weights_are_recaptured_not_replayed_stale(tmp_path):
    dataset = InferenceDataset(build_processed(tmp_path))
    cfg = config_for_dataset("tiny", dataset)
    model = sensitive_model(cfg, 0).to("cuda")
    graphed = InferenceSession(model, dataset, cuda_graphs=True)
    batch = next(iter(dataset.batches(dataset.request_indices(max_requests=8), 8)))
    before = graphed.serve(batch).logits
    replacement = sensitive_model(cfg, 1).to("cuda")
    for name, module in model.named_modules():  # new Parameter objects at new addresses
        for pname, p in list(module.named_parameters(recurse=False)):
            new = dict(replacement.named_modules())[name]._parameters[pname]
            setattr(module, pname, torch.nn.Parameter(new.detach().clone(), requires_grad=p.requires_grad))
    after = graphed.serve(batch).logits
    assert graphed.graphs.invalidations == 1 and graphed.graphs.captures == 2
    assert_logits_close(after, InferenceSession(replacement, dataset).serve(batch).logits)
    assert not torch.equal(before, after)
