"""A visit's failure stays that visit's: random valid and invalid visits share batches, and every valid
one gets exactly its offline replay's logits while each invalid one gets its own error."""
from __future__ import annotations

import numpy as np
import torch

from benchmark.harness.visits import visit_queries
from data.schema import TIME_MS_RANGE
from helpers import assert_logits_close, offline_logits
from model.attention.token_stamp import STAMP_TIME_MASK
from model.checkpoint import load_checkpoint
from serve.engine import EngineConfig, open_engine
from serve.protocol import RequestError, ScoreQuery

VALID_VISITS = 90
SEED = 43


def _invalid_visit(rng: np.random.Generator, users: np.ndarray, taken: set[int], candidates: tuple[int, ...]
                   ) -> tuple[ScoreQuery, tuple[int, str]]:
    """A visit the engine must refuse alone, and the (status, code) it must get. The protocol refuses the
    first kind before the engine sees it: here it stands for any visit whose forward raises."""
    kind = int(rng.integers(3))
    if kind == 0:  # a time past what a token stamp holds: the forward raises
        user = int(rng.choice([u for u in users.tolist() if u not in taken]))
        return ScoreQuery(user, STAMP_TIME_MASK + 1 + int(rng.integers(1 << 20)), candidates), (500, "scoring_failed")
    if kind == 1:
        return ScoreQuery(10**9 + int(rng.integers(1000)), 1_650_000_000_000, candidates), (422, "unknown_user")
    user = int(rng.choice([u for u in users.tolist() if u not in taken]))
    return ScoreQuery(user, TIME_MS_RANGE[0], candidates), (422, "no_history")


def _mixed_batches(rng: np.random.Generator, valid: list[ScoreQuery], users: np.ndarray):
    """(batch, expected) pairs: valid visits in time order, each batch's users distinct, 1-3 invalid
    visits shuffled in; expected[b] is the request index of a valid visit, else (status, code)."""
    at = 0
    while at < len(valid):
        batch, expected, taken, size = [], [], set(), int(rng.integers(1, 6))
        while at < len(valid) and len(batch) < size and valid[at].user_id not in taken:
            batch.append(valid[at])
            expected.append(int(valid[at].request_id))
            taken.add(valid[at].user_id)
            at += 1
        for _ in range(int(rng.integers(1, 4))):
            query, error = _invalid_visit(rng, users, taken, valid[0].candidate_video_ids)
            if query.user_id in taken:  # an unknown user drawn twice
                continue
            batch.append(query)
            expected.append(error)
            taken.add(query.user_id)
        order = rng.permutation(len(batch))
        yield [batch[i] for i in order], [expected[i] for i in order]


def test_random_mixed_batches_fail_only_their_invalid_visits(serving_artifacts):
    processed, checkpoint = serving_artifacts
    engine = open_engine(EngineConfig(str(processed), str(checkpoint), async_offload=False))
    try:
        dataset = engine.history
        indices = dataset.request_indices(max_requests=VALID_VISITS)
        want = offline_logits(load_checkpoint(checkpoint).model, dataset, indices)
        users = np.unique(dataset.requests.user_id)
        rng = np.random.default_rng(SEED)
        checked, refused = 0, 0
        for batch, expected in _mixed_batches(rng, visit_queries(dataset, indices), users):
            for query, result, expect in zip(batch, engine.score_batch(batch), expected):
                if isinstance(expect, int):
                    assert not isinstance(result, RequestError), (query, result)
                    assert_logits_close(torch.tensor(result.logits), want[expect])
                    checked += 1
                else:
                    assert isinstance(result, RequestError), query
                    assert (result.status, result.code) == expect, result.message
                    assert f"user {query.user_id}" in result.message
                    refused += expect[1] == "scoring_failed"
        assert checked == len(indices) and refused > 0
    finally:
        engine.shutdown()
