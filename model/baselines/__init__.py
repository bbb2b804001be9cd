"""Baselines a ranking model must beat, fitted on the training period and tuned on its holdout.

    base.py               the inputs (Interactions, Visits) and the scorer contracts
    counts.py             item popularity, user-kNN
    factorization.py      logistic matrix factorisation (+ an exposure objective)
    implicit_feedback.py  ALS, BPR and item-kNN from the `implicit` library
    markov.py             last-items Markov transitions (sequential)
    sasrec.py             a SASRec-style self-attentive model (sequential)
    affinity.py           a logistic regression over the user's affinity to the candidate's kind (sequential)
    tuning.py             grid search on the holdout's click AUC, then one refit
    registry.py           the set model/quality.py compares, with their grids

Pair scorers learn from events before the holdout (tuning) or the split date (the refit) and score
(user, video) pairs; sequential ones also read each user's events before the visit they score,
as the HSTU does when serving, never the scored visit's candidates or anything after it.
"""
from model.baselines.affinity import AffinityRegression
from model.baselines.base import Interactions, PairScorer, Visits, VisitScorer
from model.baselines.counts import ItemPopularity, UserKNN
from model.baselines.factorization import MatrixFactorization
from model.baselines.implicit_feedback import ImplicitALS, ImplicitBPR, ItemKNN
from model.baselines.markov import LastItemsMarkov
from model.baselines.sasrec import SASRec
from model.baselines.tuning import Baseline, Tuned, TuningData, grid, tune

__all__ = [
    "AffinityRegression", "Baseline", "ImplicitALS", "ImplicitBPR", "Interactions", "ItemKNN", "ItemPopularity",
    "LastItemsMarkov",
    "MatrixFactorization", "PairScorer", "SASRec", "Tuned", "TuningData", "UserKNN", "VisitScorer", "Visits",
    "grid", "tune",
]
