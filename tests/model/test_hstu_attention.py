"""hstu_attention against a dense reference written straight from the math in DESIGN.md §3."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import model.hstu as hstu


def reference(q_hist, q_cand, k_cand, v_cand, k_window, v_window, num_cached, alpha, normalizer):
    """Dense attention over [window | candidates] with the M-FALCON mask, one query row at a time."""
    n, m, T = q_hist.shape[0], q_cand.shape[0], k_window.shape[0]
    keys = torch.cat([k_window, k_cand])  # [T + m, H, D]
    values = torch.cat([v_window, v_cand])
    queries = torch.cat([q_hist, q_cand])
    outputs = []
    for i in range(n + m):
        visible = torch.zeros(T + m, dtype=torch.bool)
        if i < n:
            visible[: num_cached + i + 1] = True  # history: causal over the window
        else:
            visible[:T] = True  # candidate: all history ...
            visible[T + i - n] = True  # ... and itself, never another candidate
        a = F.silu(alpha * torch.einsum("hd,khd->hk", queries[i], keys)) / normalizer  # [H, T + m]
        a = a * visible
        outputs.append(torch.einsum("hk,khd->hd", a, values))
    out = torch.stack(outputs)
    return out[:n], out[n:]


@pytest.mark.parametrize("num_cached, n, m, tile", [
    (0, 1, 1, 1024), (0, 37, 5, 8), (20, 13, 3, 4), (50, 0, 4, 8), (3, 16, 0, 4), (9, 40, 7, 1024), (0, 9, 2, 3),
])
def test_matches_dense_reference(monkeypatch, num_cached, n, m, tile):
    monkeypatch.setattr(hstu, "QUERY_TILE", tile)
    torch.manual_seed(n * 31 + m)
    H, D = 2, 8
    t = lambda rows: torch.randn(rows, H, D, dtype=torch.float64)
    q_hist, q_cand, k_cand, v_cand = t(n), t(m), t(m), t(m)
    k_window, v_window = t(num_cached + n), t(num_cached + n)
    args = (q_cand, k_cand, v_cand, k_window, v_window, num_cached, 0.3, 64.0)
    out_hist, out_cand = hstu.hstu_attention(q_hist, *args)
    ref_hist, ref_cand = reference(q_hist, *args)
    torch.testing.assert_close(out_hist, ref_hist)
    torch.testing.assert_close(out_cand, ref_cand)
    # Without history outputs (the last layer) the candidates are unchanged.
    none_hist, cand_only = hstu.hstu_attention(None, *args)
    assert none_hist is None
    torch.testing.assert_close(cand_only, ref_cand)
