"""model/token_layout.py: which cached tokens a sliding attention window never reads again."""
from __future__ import annotations

import numpy as np

from helpers import tiny_config
from model.token_layout import TokenLayout


def test_tokens_beyond_the_attention_window_are_counted_per_window_and_the_prefix_never():
    layout = TokenLayout(tiny_config())  # 3 prefix tokens, windows of up to 253 events, stride 64
    ends = np.array([0, 10, 40, 253, 254, 300])
    # Window starts: 0 up to 253 events, then 64 (the first stride multiple leaving <= 253 events).
    assert layout.window_tokens(ends).tolist() == [3, 13, 43, 256, 193, 239]
    assert layout.tokens_never_read_again(ends, 32).tolist() == [0, 0, 8, 221, 158, 204]
    assert layout.tokens_never_read_again(ends, 0).tolist() == [0] * 6  # every key is read
    assert layout.tokens_never_read_again(ends, 1000).tolist() == [0] * 6
