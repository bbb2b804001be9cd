"""CUDA graph replays score exactly like eager forwards (CUDA only; the bucketing itself is tested on
CPU in test_batch_shape.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, make_cache, sensitive_model
from model.cuda_graphs import CUDAGraphs
from model.inference import InferenceSession
from model.train import config_for_dataset


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
