"""tools/gpu_kit.py: which wheels the GPU kit gets (the download itself needs the index: not run here)."""
from __future__ import annotations

import sys

import pytest

from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import gpu_kit


def test_the_closure_follows_requirements_for_the_machines_python():
    found = gpu_kit.closure(("aiohttp",))
    assert {"aiohttp", "multidict", "yarl", "frozenlist", "aiosignal", "propcache"} <= set(found)
    assert "async-timeout" not in found  # required below Python 3.11 only: the machine runs 3.12
    assert all(version[0].isdigit() for version in found.values())


def test_wheels_already_in_the_kit_are_known_by_their_canonical_names(tmp_path):
    for name in ("torchrec-1.6.1-py312-none-any.whl", "importlib_metadata-10.2.0-py3-none-any.whl"):
        (tmp_path / name).touch()
    assert gpu_kit.kit_packages(tmp_path) == {"torchrec", "importlib-metadata"}


def test_a_folder_without_setup_sh_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match=r"holds no setup\.sh"):
        gpu_kit.main(["--shared", str(tmp_path), "--out", str(tmp_path / "kit")])
