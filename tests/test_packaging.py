"""The wheel ships policies/, plugin/, billing/, sim/ as kvroute.* and nothing at the top level."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("policies", "plugin", "billing", "sim")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, cwd=out)
    (whl,) = out.glob("kvroute-*.whl")
    return whl


def test_wheel_holds_every_module_under_the_kvroute_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert all(t == "kvroute" or t.endswith(".dist-info") for t in tops), tops
    for folder in CODE_DIRS:
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            assert f"kvroute/{folder}/{rel.as_posix()}" in names, f"{src} is missing from the wheel"
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvroute = kvroute.plugin.cli:main" in entry


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # Dependencies come from the test environment's site-packages (no network needed); kvroute itself
    # must come from the fresh venv, not from this checkout.
    deps = sysconfig.get_paths()["purelib"]
    code = ("import kvroute.policies, kvroute.plugin, kvroute.billing, kvroute.sim, importlib.util;"
            "print(kvroute.policies.__file__);"
            "assert importlib.util.find_spec('policies') is None;"
            "assert importlib.util.find_spec('plugin') is None;"
            "assert importlib.util.find_spec('billing') is None")
    env = {**os.environ, "PYTHONPATH": deps, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert str(env_dir) in out.stdout
    cli = subprocess.run([str(env_dir / "bin" / "kvroute"), "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert cli.returncode == 0 and "bench" in cli.stdout
