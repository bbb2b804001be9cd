"""The cache, the model and the server import on a machine without the packages only some features
use (a GPU image: tools/gpu_kit.py, docs/install.md): zstandard (the zstd codecs), and implicit,
scipy and threadpoolctl (the implicit-library baselines). Asking for such a feature there names the
package it needs."""
from __future__ import annotations

import site
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import REPO_ROOT

OPTIONAL = ("zstandard", "implicit", "scipy", "threadpoolctl")


def _site_without(tmp_path: Path, packages: tuple[str, ...]) -> Path:
    """A copy of this venv's site-packages, as links, without `packages` (their modules and metadata)."""
    farm = tmp_path / "site"
    farm.mkdir()
    for source in Path(site.getsitepackages()[0]).iterdir():
        if not source.name.lower().startswith(packages):
            (farm / source.name).symlink_to(source)
    return farm


def test_the_serving_path_imports_without_the_optional_packages(tmp_path):
    farm = _site_without(tmp_path, OPTIONAL)
    program = textwrap.dedent(f"""
        import importlib.util, site, sys
        sys.path[:] = [p for p in sys.path if p not in {site.getsitepackages()!r}]
        site.addsitedir({str(farm)!r})
        assert not any(importlib.util.find_spec(m) for m in {OPTIONAL!r}), "the optional packages are still here"
        import kvcache, model, model.baselines, serve.node
        from kvcache.codecs import get_codec
        for spec in ("raw", "bf16", "int8", "sparse"):
            get_codec(spec)
        for spec in ("zstd", "zstd-channel"):
            try:
                get_codec(spec)
            except ModuleNotFoundError as err:
                assert f"Codec {{spec}} needs the zstandard package" in str(err), err
            else:
                raise AssertionError(spec + " was made without zstandard")
        from model.baselines import ImplicitALS
        try:
            ImplicitALS.library_model()
        except ModuleNotFoundError as err:
            assert err.name.startswith("implicit"), err
        else:
            raise AssertionError("the implicit library was imported")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
