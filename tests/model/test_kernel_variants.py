"""Bounded compiles: serving a replay compiles the attention kernel once per key layout, whatever its batches.

Triton compiles a variant per distinct set of constexprs, argument dtypes, int arguments' value class
(equal to 1, divisible by 16, other) and pointers' 16-byte alignment, except for the arguments it is
told not to specialise on. A variant is seconds of compile in the middle of serving, so this replays
visits of changing batch sizes, lengths and cache states through the Triton backend and counts the
distinct keys Triton's rules give to the launches.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import Visit, make_cache, random_candidates, random_histories, sensitive_model, serve, tiny_config
from model.attention import triton_attention
from model.staging import pack_layout

if not triton_attention.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (tests/conftest.py)


def _no_specialisation(kernel) -> set[str]:
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize", ())
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in names}


def _specialisation(kernel, args, kwargs) -> tuple:
    """The parts of a launch that pick Triton's compiled variant."""
    free = _no_specialisation(kernel)
    key = []
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in free:
            key.append((name, value == 1, value % 16 == 0))
    return (*key, *sorted((k, str(v)) for k, v in kwargs.items()))


class _Recorder:
    def __init__(self, kernel) -> None:
        self.kernel, self.keys, self.history_rows = kernel, [], set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(_specialisation(self.kernel, args, kwargs))
            self.history_rows.add(args[self.kernel.arg_names.index("history_rows")])
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_replay_compiles_one_attention_variant_per_key_layout(monkeypatch):
    recorder = _Recorder(triton_attention._hstu_attention_kernel)
    monkeypatch.setattr(triton_attention, "_hstu_attention_kernel", recorder)
    cfg = tiny_config()
    model = sensitive_model(cfg, 3).to(DEVICE)
    model.attention_backend = "triton"
    rng = np.random.default_rng(3)
    histories = random_histories(rng, 6, (60, 120), cfg)
    cache = make_cache(cfg, num_pages=512, device=DEVICE)
    # Batch sizes, lengths and cached prefixes all change; user 0 comes back with 1 new event, then
    # users 0 and 1 with 16 each (the int classes Triton would specialise on: 1, 16-divisible, other).
    rounds = [{0: 20, 1: 30}, {0: 21}, {0: 37, 1: 46}, {0: 40, 1: 50, 2: 33, 3: 25, 4: 41, 5: 39}, {2: 35, 4: 44}]
    for ends in rounds:
        visits = [Visit(u, end, random_candidates(rng, int(rng.integers(1, 9)))) for u, end in ends.items()]
        serve(model, cache, histories, visits)
        serve(model, None, histories, visits)
    assert {1, 32} <= recorder.history_rows and any(r % 16 and r != 1 for r in recorder.history_rows)
    paged = {k for k in recorder.keys if ("PAGE_SIZE", str(cfg.page_size)) in k}
    contiguous = {k for k in recorder.keys if ("PAGE_SIZE", "0") in k}
    assert len(recorder.keys) == len(rounds) * 2 * cfg.num_layers  # every launch seen: cached and full, per layer
    assert len(paged) == 1 and len(contiguous) == 1, (len(paged), len(contiguous))


def test_every_staged_array_is_16_byte_aligned():
    """The batch's one upload: pointer alignment must not depend on the sizes of the arrays before it."""
    arrays = {"a": np.zeros(3, np.int32), "b": np.zeros(5, np.int64), "c": np.zeros(1, np.bool_),
              "d": np.zeros(7, np.float32), "e": np.zeros(0, np.int32), "f": np.zeros(2, np.int32)}
    layout, total = pack_layout(arrays)
    assert [s.name for s in layout] == list(arrays)
    assert all(s.offset % 16 == 0 for s in layout) and total % 16 == 0
    ends = [s.offset + arrays[s.name].nbytes for s in layout]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout[1:]))  # no overlap
