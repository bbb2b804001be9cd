"""What a training epoch walks and at what rate: the visits packed into shuffled batches of distinct
users, and the learning-rate factor of each step (linear warm-up, cosine decay; the candidate-only
terms' delay)."""
from __future__ import annotations

import math

import numpy as np

from data.dataset import InferenceDataset

# Marks the optimiser groups of the candidate-only terms (TrainParams.candidate_terms_delay_epochs).
CANDIDATE_TERM = "candidate_term"


def shuffled_batches(dataset: InferenceDataset, indices: np.ndarray, batch_size: int,
                     rng: np.random.Generator) -> list[np.ndarray]:
    """The visits in random order (batches i.i.d. across time), packed first-fit into batches of
    distinct users (a batch holds each user at most once). Cutting the shuffled list wherever a user
    repeats (`InferenceDataset.batches`) leaves batches half empty when a few users own many visits;
    first-fit fills them, so an epoch takes fewer, fuller steps."""
    users = dataset.requests.user_id
    batches: list[list[int]] = []
    members: list[set[int]] = []
    # A batch that is full, or holds the user, stays so: each user's search resumes where its last
    # one ended, and every search skips the leading full batches (first-fit, in linear-ish time).
    resume: dict[int, int] = {}
    first_open = 0
    for index in indices[rng.permutation(len(indices))].tolist():
        user = int(users[index])
        target = max(resume.get(user, 0), first_open)
        while target < len(batches) and (len(batches[target]) >= batch_size or user in members[target]):
            target += 1
        if target == len(batches):
            batches.append([])
            members.append(set())
        batches[target].append(index)
        members[target].add(user)
        resume[user] = target + 1
        while first_open < len(batches) and len(batches[first_open]) >= batch_size:
            first_open += 1
    return [np.asarray(batches[b], dtype=np.int64) for b in rng.permutation(len(batches))]


def schedule(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 0.1 at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def group_factor(group: dict, factor: float, step: int, delay_steps: int, warmup: int) -> float:
    """A parameter group's learning-rate factor at `step`, given the schedule's `factor`: the
    candidate-only terms get nothing until `delay_steps`, then a warm-up of their own into it."""
    if not group.get(CANDIDATE_TERM) or not delay_steps:
        return factor
    if step < delay_steps:
        return 0.0
    return factor * min(1.0, (step - delay_steps + 1) / max(1, warmup))
