"""Installable package: `pip install -e .` makes `data`, `model` and `kvcache` importable.

Versions are pinned in requirements.txt (the one place); torchrec is listed separately in
requirements-torchrec.txt because it must be installed with --no-deps (its declared
dependency is the CUDA build of fbgemm-gpu, which would replace fbgemm-gpu-cpu).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
TEST_ONLY = {"pytest", "hypothesis", "ruff"}


def _requirements(name: str) -> list[str]:
    lines = (HERE / name).read_text().splitlines()
    reqs = [ln.split("#")[0].strip() for ln in lines]
    return [r for r in reqs if r and r.split("==")[0] not in TEST_ONLY]


setup(
    name="hstu-kvcache-inference",
    version="0.1.0",
    description="HSTU generative-recommender inference with a user-keyed paged KV cache",
    python_requires=">=3.10",
    packages=find_packages(include=["data", "data.*", "model", "model.*", "kvcache", "kvcache.*"]),
    py_modules=["preprocessor_inference"],
    install_requires=_requirements("requirements.txt"),
    extras_require={"test": ["pytest", "hypothesis", "ruff"]},
    entry_points={"console_scripts": ["hstu-preprocess=preprocessor_inference:main"]},
)
