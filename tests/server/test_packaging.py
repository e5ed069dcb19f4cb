"""Packaging: every package directory is listed in pyproject, and the console script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package_directory():
    """pyproject lists packages explicitly (so that `server/` installs as `dspark_server`); a new
    package directory missing from the list would be absent from a wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: ROOT / path for name, path in setuptools.get("package-dir", {}).items()}
    listed = {mapped.get(name, ROOT / name.replace(".", "/")) for name in setuptools["packages"]}
    on_disk = {p.parent for top in ("dspark", "server") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(map(str, on_disk - listed))}"
    assert mapped["dspark_server"] == ROOT / "server"


def test_console_script_help_runs_outside_the_repository(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from dspark_server.__main__ import main; main(['--help'])"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--host", "--port", "--api-key", "--drafter", "--draft-tokens", "--max-running",
                 "--max-waiting", "--max-prompt-tokens", "--max-tokens", "--served-model-name"):
        assert flag in out.stdout


def test_the_table_of_sampled_rounds_reaches_the_engine_config(tmp_path):
    """`--capacity-sampled` loads a table (a shipped name here) into `EngineConfig.capacity_sampled`; a
    missing file is named."""
    from dspark_server.__main__ import build_parser, engine_config

    config = engine_config(build_parser().parse_args(["--draft-tokens", "auto",
                                                      "--capacity-sampled", "h200-v4-mini-ctx4k"]))
    assert config.capacity is None and config.capacity_sampled.label.startswith("NVIDIA H200")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        engine_config(build_parser().parse_args(["--capacity-sampled", str(tmp_path / "nope.json")]))
