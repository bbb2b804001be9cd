"""Baselines a ranking model must beat, fitted on the training period.

    base.py               the inputs (Interactions, Visits) and the scorer contracts
    counts.py             item popularity, user-kNN
    factorization.py      logistic matrix factorisation (+ an exposure objective)
"""
from model.baselines.base import Interactions, PairScorer, Visits, VisitScorer
from model.baselines.counts import ItemPopularity, UserKNN
from model.baselines.factorization import MatrixFactorization

__all__ = ["Interactions", "ItemPopularity", "MatrixFactorization", "PairScorer", "UserKNN", "VisitScorer", "Visits"]
