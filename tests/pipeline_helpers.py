"""A tiny generated KuaiRand-1K, preprocessed: the real data path, small enough for tests."""
from __future__ import annotations

from pathlib import Path

from data.manifest import PreprocessParams
from data.preprocess import preprocess
from data.synthetic import generate


def build_processed(root: Path, scale: float = 0.002, seed: int = 3, num_candidates: int = 16) -> Path:
    """Generate raw files into root/raw and preprocess them into root/processed."""
    generate(root / "raw", scale=scale, seed=seed, progress=False)
    preprocess(root / "raw", root / "processed", PreprocessParams(num_candidates=num_candidates), progress=False)
    return root / "processed"
