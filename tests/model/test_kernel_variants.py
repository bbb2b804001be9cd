"""Bounded compiles: serving a replay compiles the attention kernel once per key layout, whatever its batches.

A variant is seconds of compile in the middle of serving, so this replays visits of changing batch
sizes, lengths and cache states through the Triton backend and counts the distinct keys Triton's
rules give to the launches (model/kernel_variants.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import Visit, make_cache, random_candidates, random_histories, sensitive_model, serve, tiny_config
from model.attention import recording_variants, triton_attention
from model.kernel_variants import TritonLaunches
from model.staging import pack_layout

if not triton_attention.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (tests/conftest.py)


def test_a_replay_compiles_one_attention_variant_per_key_layout():
    cfg = tiny_config()
    model = sensitive_model(cfg, 3).to(DEVICE)
    model.attention_backend = "triton"
    rng = np.random.default_rng(3)
    histories = random_histories(rng, 6, (60, 120), cfg)
    cache = make_cache(cfg, num_pages=512, device=DEVICE)
    # Batch sizes, lengths and cached prefixes all change; user 0 comes back with 1 new event, then
    # users 0 and 1 with 16 each (the int classes Triton would specialise on: 1, 16-divisible, other).
    rounds = [{0: 20, 1: 30}, {0: 21}, {0: 37, 1: 46}, {0: 40, 1: 50, 2: 33, 3: 25, 4: 41, 5: 39}, {2: 35, 4: 44}]
    with TritonLaunches() as recorder, recording_variants() as met:
        for ends in rounds:
            visits = [Visit(u, end, random_candidates(rng, int(rng.integers(1, 9)))) for u, end in ends.items()]
            serve(model, cache, histories, visits)
            serve(model, None, histories, visits)
    history_rows = recorder.int_arguments["history_rows"]
    assert {1, 32} <= history_rows and any(r % 16 and r != 1 for r in history_rows)
    paged = {k for k in recorder.keys if ("PAGE_SIZE", str(cfg.page_size)) in k}
    contiguous = {k for k in recorder.keys if ("PAGE_SIZE", "0") in k}
    assert len(recorder.keys) == len(rounds) * 2 * cfg.num_layers  # every launch seen: cached and full, per layer
    assert len(paged) == 1 and len(contiguous) == 1, (len(paged), len(contiguous))
    assert sorted(v.page_size for v in met) == [0, cfg.page_size]  # the backend's own account: one per key layout


def test_every_staged_array_is_16_byte_aligned():
    """The batch's one upload: pointer alignment must not depend on the sizes of the arrays before it."""
    arrays = {"a": np.zeros(3, np.int32), "b": np.zeros(5, np.int64), "c": np.zeros(1, np.bool_),
              "d": np.zeros(7, np.float32), "e": np.zeros(0, np.int32), "f": np.zeros(2, np.int32)}
    layout, total = pack_layout(arrays)
    assert [s.name for s in layout] == list(arrays)
    assert all(s.offset % 16 == 0 for s in layout) and total % 16 == 0
    ends = [s.offset + arrays[s.name].nbytes for s in layout]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout[1:]))  # no overlap
