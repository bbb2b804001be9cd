"""Baselines a ranking model must beat, fitted on the training period.

    base.py               the inputs (Interactions, Visits) and the scorer contracts
    counts.py             item popularity, user-kNN
    factorization.py      logistic matrix factorisation (+ an exposure objective)
    implicit_feedback.py  ALS, BPR and item-kNN from the `implicit` library
"""
from model.baselines.base import Interactions, PairScorer, Visits, VisitScorer
from model.baselines.counts import ItemPopularity, UserKNN
from model.baselines.factorization import MatrixFactorization
from model.baselines.implicit_feedback import ImplicitALS, ImplicitBPR, ItemKNN

__all__ = [
    "ImplicitALS", "ImplicitBPR", "Interactions", "ItemKNN", "ItemPopularity", "MatrixFactorization", "PairScorer",
    "UserKNN", "VisitScorer", "Visits",
]
