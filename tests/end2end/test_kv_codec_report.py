"""benchmark/kvcache/codec_report.py end to end on tiny data: exact codecs report no logit change, lossy ones a
small one and fewer bytes, and the full-recompute reference is written once and reused."""
from __future__ import annotations

import json

import pytest

from helpers import build_processed


@pytest.fixture(scope="module")
def report():
    from benchmark.kvcache import codec_report

    return codec_report


def test_report_rows_per_codec_and_a_reused_reference(report, tmp_path):
    processed = build_processed(tmp_path / "data")
    reference = tmp_path / "full.npz"
    common = ["--data_dir", str(processed), "--preset", "tiny", "--max_requests", "24", "--full_reference", str(reference)]
    assert report.main([*common, "--codecs", "zstd", "zstd-channel", "int8", "sparse:keep=20,merge=0,recent=0",
                        "--output", str(tmp_path / "a.json")]) == 0
    rows = json.loads((tmp_path / "a.json").read_text())["codecs"]
    sparse = "sparse:keep=20,merge=0,recent=0,score=vnorm,values=raw"
    assert list(rows) == ["raw", "zstd:level=3,shuffle=1", "zstd-channel", "int8:mode=sym", sparse]
    assert rows["raw"]["max_abs_logit_diff_vs_full"] == 0
    assert rows["zstd:level=3,shuffle=1"]["max_abs_logit_diff_vs_raw"] == 0 == rows["zstd-channel"]["max_abs_logit_diff_vs_raw"]
    assert all(r["tokens_reused"] > 0 for r in rows.values())
    lossy = [rows["int8:mode=sym"], rows[sparse]]
    assert all(r["max_abs_logit_diff_vs_raw"] > 0 and r["bytes_ratio_vs_raw_pages"] > 1.5 for r in lossy)
    stamp = reference.stat().st_mtime_ns
    assert report.main([*common, "--codecs", "bf16", "--output", str(tmp_path / "b.json")]) == 0
    assert reference.stat().st_mtime_ns == stamp  # read, not replayed again
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["full_recompute_auc"] == json.loads((tmp_path / "a.json").read_text())["full_recompute_auc"]
