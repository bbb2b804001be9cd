"""KuaiRand-1K data: raw schema and loader, synthetic generator, preprocessing, dataset.

Exports resolve lazily (PEP 562) and the data layer is numpy/pyarrow only, so the preprocessing
CLI, the generator and the history stores' tools never pay for importing torch.
The entry points are functions in their own modules (`data.preprocess.preprocess`,
`data.synthetic.generate`): a package attribute named like a submodule gets shadowed.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "VisitBatch": "data.batch",
    "InferenceDataset": "data.dataset",
    "Manifest": "data.manifest",
    "PreprocessParams": "data.manifest",
    "RequestTable": "data.requests",
    "RawDataError": "data.raw",
    "SyntheticConfig": "data.synthetic",
}

__all__ = [
    "InferenceDataset",
    "Manifest",
    "PreprocessParams",
    "RawDataError",
    "RequestTable",
    "SyntheticConfig",
    "VisitBatch",
]
assert sorted(_EXPORTS) == __all__

if TYPE_CHECKING:
    from data.batch import VisitBatch
    from data.dataset import InferenceDataset
    from data.manifest import Manifest, PreprocessParams
    from data.raw import RawDataError
    from data.requests import RequestTable
    from data.synthetic import SyntheticConfig


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
