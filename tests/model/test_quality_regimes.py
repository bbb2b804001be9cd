"""benchmark/quality/regimes.py: the row it reads from a run's three JSON files, its table and picture,
its resume rule, and its refusal of an unknown regime (the steps themselves are the benchmarks' own)."""
from __future__ import annotations

import json

import pytest

from benchmark.quality import regimes as quality_regimes


def _write_run(home, hstu: float, best: float, shuffled: float | None) -> None:
    home.mkdir(parents=True)
    (home / "quality.json").write_text(json.dumps({"seeds": [{
        "auc": {"HSTU": {"click": hstu}}, "click_best_baseline": {"name": "SASRec", "auc": best},
        "click_margin": hstu - best, "training": {"seconds": 12.5}}]}))
    variants = {"as logged": {"click_auc_change": None}, "history-free": {"click_auc_change": {"estimate": -0.08}}}
    if shuffled is not None:
        variants["shuffled"] = {"click_auc_change": {"estimate": shuffled}}
    (home / "ablation.json").write_text(json.dumps({"variants": variants}))
    (home / "bounds.json").write_text(json.dumps({"auc": {"history in order": 0.79}}))


def test_a_row_reads_the_margin_the_ablation_and_the_bounds(tmp_path):
    _write_run(tmp_path / "a", hstu=0.66, best=0.63, shuffled=-0.06)
    row = quality_regimes.summarise("dense-absent-sequential", 1, tmp_path / "a")
    assert row["margin"] == pytest.approx(0.03) and row["best_baseline"]["name"] == "SASRec"
    assert (row["shuffled_delta"], row["history_free_delta"]) == (-0.06, -0.08)
    assert row["bounds"] == {"history in order": 0.79} and row["training_seconds"] == 12.5
    _write_run(tmp_path / "b", hstu=0.60, best=0.61, shuffled=None)
    rows = [row, quality_regimes.summarise("sparse-absent-taste", 0, tmp_path / "b")]
    table = quality_regimes.format_rows(rows).splitlines()
    assert len(table) == 3 and "+0.0300" in table[1] and "-0.0600" in table[1] and "-0.0100" in table[2]
    quality_regimes.plot(rows, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 1000


def test_steps_whose_output_exists_are_not_run_again(tmp_path, monkeypatch):
    home = tmp_path / "dense-absent-taste" / "seed_0"
    _write_run(home, hstu=0.7, best=0.65, shuffled=-0.01)
    for marker in (home / "raw" / "user_features_1k.csv", home / "processed" / "manifest.json"):
        marker.parent.mkdir(parents=True)
        marker.write_text("")
    ran = []
    monkeypatch.setattr(quality_regimes, "_run", lambda command, log: ran.append(command))
    args = quality_regimes.parse_args(["--out", str(tmp_path), "--regimes", "dense-absent-taste", "--seeds", "0"])
    row = quality_regimes.run_regime("dense-absent-taste", 0, args)
    assert ran == [] and row["hstu"] == 0.7


def test_an_unknown_regime_is_refused(capsys):
    with pytest.raises(SystemExit):
        quality_regimes.parse_args(["--out", "x", "--regimes", "dense-sequential"])
    assert "invalid choice: 'dense-sequential'" in capsys.readouterr().err
