"""Serving is batch-shaped: no host syncs in a forward, and the op count does not grow with the batch.

Counted with a TorchDispatchMode on CPU (model/op_counter.py): every aten op is at least one kernel
launch on a GPU, and sync-class ops make the host wait for the device. On the Triton path each kernel
launch counts as one op (model/kernel_variants.launches_as_one_op), as on a GPU, not the ops Triton's
CPU interpreter dispatches to emulate it.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest

from data.dataset import InferenceDataset
from helpers import build_processed, make_cache, sensitive_model
from model.attention import triton_attention
from model.config import config_for_dataset
from model.inference import InferenceSession
from model.op_counter import OpCounter
from model.video_tags import VideoTagTable


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return InferenceDataset(build_processed(tmp_path_factory.mktemp("shape")))


def _warm_session(dataset, cached: bool, backend: str = "blocked", tag_match: bool = False):
    cfg = config_for_dataset("tiny", dataset)
    tags = VideoTagTable.from_dataset_dir(dataset.root) if tag_match else None
    if tags is not None:  # every token's stamp then carries its tag, and every layer reads the match
        cfg = cfg.replace(num_video_tags=tags.num_rows, tag_match_bias=True)
    model = sensitive_model(cfg, 0)
    if tags is not None:
        model.video_tags = tags
    model.attention_backend = backend
    session = InferenceSession(model, dataset, kv_cache=make_cache(cfg, num_pages=2048) if cached else None)
    batches = list(dataset.batches(dataset.request_indices(), 8))
    for batch in batches[:30]:  # users come back: their cache is warm
        session.serve(batch)
    return session, batches[30:]


@pytest.mark.parametrize("backend", ["blocked", "triton"])
@pytest.mark.parametrize("cached, tag_match", [(True, False), (False, False), (True, True)],
                         ids=["cached", "full", "cached-tag-match"])
def test_serve_has_no_sync_ops_and_flat_op_counts(dataset, cached, tag_match, backend):
    """The whole visit (planning, forward, commit, offload to the host tier), on the CPU path and on the
    Triton path the GPU runs (its kernel under the interpreter); with the tag-match term too."""
    if backend == "triton" and not triton_attention.available():
        pytest.skip("triton is not installed")
    session, later = _warm_session(dataset, cached, backend, tag_match)
    batch_of_8 = next(b for b in later if len(b) == 8)
    batch_of_1 = later[-1][:1]

    def launches(counter: OpCounter):
        if backend != "triton":
            return nullcontext()
        from model.kernel_variants import launches_as_one_op

        return launches_as_one_op(counter)

    with OpCounter() as ops_8, launches(ops_8):
        result = session.serve(batch_of_8)
    with OpCounter() as ops_1, launches(ops_1):
        session.serve(batch_of_1)
    if cached:
        assert result.tokens_reused > 0  # the batch really continued cached users
    if backend == "triton":  # one attention launch per layer, whatever the batch (the K/V append is the CPU op here)
        for ops in (ops_8, ops_1):
            assert ops.counts["triton::_hstu_attention_kernel"] == session.model.config.num_layers
    assert not ops_8.syncs and not ops_1.syncs, (ops_8.syncs, ops_1.syncs)
    # Kernel-running ops (views launch nothing): on the Triton path, with each launch one op, the total with
    # views is 1.4x, from the offload's per-user page gathers (kvcache/residency.py: pool.copy_out per user).
    assert ops_8.kernels <= 1.3 * ops_1.kernels, (ops_8.kernels, ops_1.kernels,
                                                  (ops_8.counts - ops_1.counts).most_common(8))


def test_the_op_counter_sees_syncs_and_per_user_loops():
    """The proxy itself: a per-user loop and an .item() are what the assertions above would catch."""
    import torch

    x = torch.arange(8.0)
    with OpCounter() as loop:
        for i in range(8):
            x[i : i + 1].mul_(2)
        float(x.sum())
    with OpCounter() as batched:
        x.mul_(2)
    assert loop.total >= 8 * batched.total and loop.syncs["aten::_local_scalar_dense"] == 1
    assert float(x[1]) == 4.0  # both loops ran
