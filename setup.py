"""Installable package: `pip install -e .` makes `data`, `model`, `kvcache`, `serve` importable.

Versions are pinned in constraints.txt (the one place, docs/install.md). The device stack is
an extra, so that a GPU machine never pulls fbgemm's CPU build: `pip install -e .[cuda] -c
constraints.txt` or `.[cpu]`. torchrec is installed separately with --no-deps
(requirements-torchrec.txt): its declared dependency is fbgemm's CUDA build.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _names(requirements_file: str) -> list[str]:
    lines = (HERE / requirements_file).read_text().splitlines()
    names = [ln.split("#")[0].strip() for ln in lines]
    return [n for n in names if n]


setup(
    name="hstu-kvcache-inference",
    version="0.2.0",
    description="HSTU generative-recommender inference with a user-keyed paged KV cache",
    python_requires=">=3.10",
    packages=find_packages(include=[f"{p}{s}" for p in ("data", "model", "kvcache", "serve", "history") for s in ("", ".*")]),
    py_modules=["preprocessor_inference"],
    install_requires=_names("requirements.txt"),
    extras_require={
        "cpu": _names("requirements-cpu.txt"),
        "cuda": _names("requirements-cuda.txt"),
        "test": _names("requirements-dev.txt"),
    },
    entry_points={"console_scripts": ["hstu-preprocess=preprocessor_inference:main"]},
)
