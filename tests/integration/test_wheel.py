"""The wheel carries what the installed commands need: the shipped configs (resolved by name
through importlib.resources), the builtin data and the bench package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from foxhunt_jax.config import CONFIG_DIR, load_config, resolve_config_path

ROOT = Path(__file__).resolve().parents[2]
# what a build reads: everything at the top level but history, environments and outputs
_NOT_BUILT = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".hypothesis", "benchmarks")


def _setuptools_builds_pyproject() -> bool:
    """pyproject.toml's SPDX ``license`` string needs setuptools 77 or later."""
    try:
        return int(version("setuptools").split(".")[0]) >= 77
    except Exception:
        return False


@pytest.mark.skipif(not _setuptools_builds_pyproject(),
                    reason="needs setuptools>=77 in this environment (the test extra has it)")
def test_wheel_ships_configs_data_and_the_bench_package(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_NOT_BUILT)
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [wheel] = out.glob("foxhunt_jax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped and {f"foxhunt_jax/configs/{n}" for n in shipped} <= names
    assert {"foxhunt_jax/bench/__init__.py", "foxhunt_jax/bench/__main__.py",
            "foxhunt_jax/bench/runner.py", "foxhunt_jax/bench/replay.py"} <= names
    assert any(n.startswith("foxhunt_jax/data/builtin/") and n.endswith(".csv.gz")
               for n in names)
    assert any(n.startswith("pallas_kernels/") for n in names)
    assert not any(n.startswith(("scripts/", "tests/", "configs/")) for n in names)


def test_config_names_resolve_to_the_shipped_files(tmp_path, monkeypatch):
    """From any working directory, ``smoke`` and ``configs/smoke.yaml`` name the shipped file,
    the same bytes as the repository's configs/smoke.yaml; an existing path wins."""
    monkeypatch.chdir(tmp_path)
    for name in ("smoke", "smoke.yaml", "configs/smoke.yaml"):
        path = resolve_config_path(name)
        assert path.parent == CONFIG_DIR
        assert path.read_bytes() == (ROOT / "configs" / "smoke.yaml").read_bytes()
    own = tmp_path / "smoke.yaml"
    own.write_text("train:\n  epochs: 3\n")
    assert resolve_config_path("smoke.yaml") == Path("smoke.yaml")
    assert load_config("smoke.yaml").train.epochs == 3
