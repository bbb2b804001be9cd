"""The baseline set the quality comparison fits, each with the grid it is tuned over (model.baselines.tuning).

Grids are small on purpose: a few values of the knobs each family is known to be sensitive to, so that
the whole set fits in minutes on the demo data. docs/model.md lists them with what was picked.
"""
from __future__ import annotations

from dataclasses import replace

from model.baselines.affinity import AffinityRegression
from model.baselines.counts import ItemPopularity, UserKNN
from model.baselines.factorization import MatrixFactorization
from model.baselines.implicit_feedback import SIGNALS, WEIGHTINGS, ImplicitALS, ImplicitBPR, ItemKNN
from model.baselines.markov import LastItemsMarkov
from model.baselines.sasrec import SASRec
from model.baselines.tuning import Baseline, grid

HISTORY_EVENTS = 50  # history events each visit carries for the sequential baselines (their longest input)

_MARKOV = dict(last_events=(1, 5, 20), shrinkage=(1.0, 10.0), prior=(5.0, 20.0, 100.0))

BASELINES: tuple[Baseline, ...] = (
    Baseline(ItemPopularity, ({},)),
    Baseline(UserKNN, grid(neighbours=(5, 10, 20, 40))),
    Baseline(MatrixFactorization, grid(dim=(16, 32), l2=(1e-4, 1e-5), exposure_weight=(0.0, 1.0, 3.0, 10.0)), seeded=True),
    Baseline(ImplicitALS, grid(factors=(16, 64), regularization=(1.0, 10.0, 100.0), signal=SIGNALS), seeded=True),
    Baseline(ImplicitBPR, grid(factors=(16, 64), learning_rate=(0.01, 0.05), iterations=(50, 200), signal=SIGNALS),
             seeded=True),
    Baseline(ItemKNN, grid(neighbours=(100, 500, 2000), weighting=WEIGHTINGS, signal=SIGNALS)),
    Baseline(LastItemsMarkov, grid(**_MARKOV), tag_grid=grid(**_MARKOV, level=("tag",))),
    Baseline(SASRec, grid(blocks=(1, 2), dropout=(0.1, 0.3)), seeded=True,
             tag_grid=grid(blocks=(1, 2), dropout=(0.1, 0.3), level=("tag", "both"))),
    Baseline(AffinityRegression, grid(last_events=(10, 50)), tag_grid=grid(last_events=(10, 50), level=("tag",))),
)

# The same baselines with one point each (two where the level is tuned), the points the full grids
# settle on most often: for `make demo` (benchmark/quality/against_baselines.py --quick), whose time budget the full
# grids would overrun. The regimes benchmark and the figures in the docs use the full grids.
_QUICK = {
    UserKNN.name: (dict(neighbours=10),),
    MatrixFactorization.name: (dict(dim=16, l2=1e-4, exposure_weight=0.0),),
    ImplicitALS.name: (dict(factors=64, regularization=10.0, signal="actions"),),
    ImplicitBPR.name: (dict(factors=16, learning_rate=0.05, iterations=200, signal="actions"),),
    ItemKNN.name: (dict(neighbours=500, weighting="bm25", signal="actions"),),
    LastItemsMarkov.name: (dict(last_events=20, shrinkage=1.0, prior=100.0),),
    SASRec.name: (dict(blocks=2, dropout=0.3),),
    AffinityRegression.name: (dict(last_events=50),),
}
_QUICK_TAGS = {
    LastItemsMarkov.name: (dict(last_events=20, shrinkage=1.0, prior=100.0, level="tag"),),
    SASRec.name: (dict(blocks=2, dropout=0.3, level="both"),),
    AffinityRegression.name: (dict(last_events=50, level="tag"),),
}
QUICK_BASELINES: tuple[Baseline, ...] = tuple(
    replace(b, grid=_QUICK.get(b.name, b.grid), tag_grid=_QUICK_TAGS.get(b.name, ())) for b in BASELINES)
