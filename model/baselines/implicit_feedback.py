"""Implicit-feedback baselines from the `implicit` library: ALS, BPR and item-kNN.

Each fits one user x video matrix built from the training events and scores a (user, video) pair
with it; the score is the same for every task (these models learn one notion of "the user wants
this video"). What goes into the matrix is a tuned choice (`signal`):

    "actions"     clicks + long views: an exposure's weight is 0, 1 or 2 (0 = not an entry)
    "exposures"   1 + clicks + long views: every exposure is a weak positive, since the logged
                  policy shows users what it expects them to like, and a video seen once or twice
                  is placed by who saw it more than by whether they clicked

The six other tasks are too rare to fit a matrix of their own (0.05-1.8% of events: tens of positives
in the demo's training period). Ids absent from the training events: an unseen video scores what the
user's average training video scores, an unseen user is the average user (mean factors, or for
item-kNN the mean user row). All fits run single-threaded (the machine's cores are shared).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from data.jagged import sorted_lookup
from data.schema import TASKS
from model.baselines.base import Interactions, PairScorer

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

# `implicit`, scipy and threadpoolctl are imported where a baseline is fitted: the model and the
# serving path import this package without them (a GPU image has only what serving needs).

SIGNALS = ("actions", "exposures")
POSITIVE_TASKS = (TASKS.index("click"), TASKS.index("long_view"))
WEIGHTINGS = ("cosine", "bm25")


def _check(signal: str, **counts: int) -> None:
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {signal!r}")
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class _UserVideoMatrix:
    """The training events as a [users, videos] CSR of `signal` weights, and the id <-> row maps."""

    def __init__(self, train: Interactions, signal: str):
        from scipy.sparse import csr_matrix

        self.users, user_row = np.unique(train.user_ids, return_inverse=True)
        self.videos, video_row = np.unique(train.video_ids, return_inverse=True)
        weight = train.labels[:, list(POSITIVE_TASKS)].sum(axis=1)
        if signal == "exposures":
            weight = weight + 1.0
        # Duplicated (user, video) rows add up: a video watched twice counts twice.
        self.matrix = csr_matrix((weight.astype(np.float32), (user_row, video_row)),
                                 shape=(len(self.users), len(self.videos)))
        self.matrix.eliminate_zeros()
        self.num_tasks = train.num_tasks

    def rows(self, user_ids: np.ndarray, video_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """-> (user rows, user known, video rows, video known)."""
        return (*sorted_lookup(self.users, user_ids), *sorted_lookup(self.videos, video_ids))

    def per_task(self, score: np.ndarray) -> np.ndarray:
        """[M] -> [M, num_tasks] float64: one score for every task."""
        return np.repeat(score.astype(np.float64)[:, None], self.num_tasks, axis=1)


def _fit_quietly(model, matrix: csr_matrix) -> None:
    """`implicit` fit with one BLAS thread (it runs its own loops and warns when BLAS would spawn
    more) and without its note that it converted its own internal COO product to CSR."""
    from implicit.utils import ParameterWarning
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, "blas"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ParameterWarning)
        model.fit(matrix, show_progress=False)


class _FactorScorer(PairScorer):
    """A factor model of `implicit` (`library_model()`, built from `params`); score = user factors .
    video factors; unseen ids read the mean factors."""

    @staticmethod
    def library_model() -> type:
        raise NotImplementedError

    def __init__(self, signal: str, seed: int, **params: float):
        _check(signal, factors=params["factors"], iterations=params["iterations"])
        self.params, self.signal, self.seed = params, signal, seed

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> _FactorScorer:
        # One thread: implicit's BPR updates factors from several threads without locks, so more than one
        # makes a fit depend on the scheduling (and the machine's cores are shared).
        model = self.library_model()(**self.params, random_state=self.seed, num_threads=1)
        self.data = _UserVideoMatrix(train, self.signal)
        _fit_quietly(model, self.data.matrix)
        self.user_factors = np.asarray(model.user_factors, dtype=np.float64)
        self.video_factors = np.asarray(model.item_factors, dtype=np.float64)
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        u, u_known, v, v_known = self.data.rows(user_ids, video_ids)
        users = np.where(u_known[:, None], self.user_factors[u], self.user_factors.mean(axis=0))
        videos = np.where(v_known[:, None], self.video_factors[v], self.video_factors.mean(axis=0))
        return self.data.per_task((users * videos).sum(axis=1))


class ImplicitALS(_FactorScorer):
    """Weighted ALS (Hu, Koren, Volinsky): confidence 1 + alpha x weight on the entries, 1 elsewhere."""

    name = "ALS (implicit)"

    @staticmethod
    def library_model() -> type:
        from implicit.cpu.als import AlternatingLeastSquares

        return AlternatingLeastSquares

    def __init__(self, factors: int = 32, regularization: float = 1.0, alpha: float = 1.0, iterations: int = 15,
                 signal: str = "actions", seed: int = 0):
        super().__init__(signal, seed, factors=factors, regularization=regularization, alpha=alpha,
                         iterations=iterations)


class ImplicitBPR(_FactorScorer):
    """Bayesian personalised ranking: a user's entries ranked above sampled other videos (SGD)."""

    name = "BPR (implicit)"

    @staticmethod
    def library_model() -> type:
        from implicit.cpu.bpr import BayesianPersonalizedRanking

        return BayesianPersonalizedRanking

    def __init__(self, factors: int = 32, learning_rate: float = 0.05, regularization: float = 0.01,
                 iterations: int = 100, signal: str = "actions", seed: int = 0):
        super().__init__(signal, seed, factors=factors, learning_rate=learning_rate, regularization=regularization,
                         iterations=iterations)


class ItemKNN(PairScorer):
    """Item-based collaborative filtering: score(u, c) = sum over the user's training videos i of
    weight(u, i) x similarity(i, c), each video keeping its `neighbours` most similar ones."""

    name = "item-kNN (implicit)"

    def __init__(self, neighbours: int = 100, weighting: str = "cosine", signal: str = "actions"):
        _check(signal, neighbours=neighbours)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
        self.neighbours, self.weighting, self.signal = neighbours, weighting, signal

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> ItemKNN:
        from implicit.nearest_neighbours import BM25Recommender, CosineRecommender

        self.data = _UserVideoMatrix(train, self.signal)
        cls = CosineRecommender if self.weighting == "cosine" else BM25Recommender
        model = cls(K=self.neighbours, num_threads=1)
        _fit_quietly(model, self.data.matrix)
        self.user_scores = (self.data.matrix @ model.similarity).tocsr()  # [U, V] sum_i weight(u, i) sim(i, .)
        self.user_mean = np.asarray(self.user_scores.mean(axis=1)).ravel()  # [U] the user's average video
        self.video_mean = np.asarray(self.user_scores.mean(axis=0)).ravel()  # [V] the average user's score
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        u, u_known, v, v_known = self.data.rows(user_ids, video_ids)
        both = u_known & v_known
        out = np.full(len(user_ids), self.user_mean.mean())  # neither known: the average user and video
        out[both] = np.asarray(self.user_scores[u[both], v[both]]).ravel()
        only_user, only_video = u_known & ~v_known, ~u_known & v_known
        out[only_user] = self.user_mean[u[only_user]]
        out[only_video] = self.video_mean[v[only_video]]
        return self.data.per_task(out)
