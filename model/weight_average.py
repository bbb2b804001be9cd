"""An exponential moving average of a model's parameters while it trains (Polyak averaging).

The holdout scores, and early stopping keeps, the averaged weights rather than the last step's: on
small logs consecutive steps' weights move by more than the signal a batch carries, and their
average ranks the holdout more steadily than any one of them.

    average = WeightAverage(model.parameters(), decay=0.99)
    for batch in batches:
        ...; optimizer.step()
        average.update()
    with average.swapped_in():
        holdout = score(model)        # the averaged weights, in the model's own tensors
    # the training weights are back

The decay warms up as min(decay, (1 + t) / (10 + t)) at update t, so the first updates do not
drag the average towards the initial weights (an epoch of 46 steps would otherwise keep 63% of
them at 0.99).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class WeightAverage:
    def __init__(self, parameters: Iterable[nn.Parameter], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the weight average's decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.parameters = [p for p in parameters if p.requires_grad]
        with torch.no_grad():
            self.averaged = [p.detach().clone() for p in self.parameters]
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters as they are now (after an optimiser step)."""
        torch._foreach_lerp_(self.averaged, self.parameters, 1.0 - self.current_decay())
        self.updates += 1

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model's parameters inside the block; the training weights after."""
        with torch.no_grad():
            training = [p.detach().clone() for p in self.parameters]
            torch._foreach_copy_(self.parameters, self.averaged)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.parameters, training)
