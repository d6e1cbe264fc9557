"""Build kvroute's wheel and run it from a fresh venv that sees only some of this environment's packages.

``bare_python(tmp, blocked)`` installs the wheel (no deps, offline) into a new venv and gives it a folder of
links to this environment's site-packages minus the ``blocked`` top-level modules, i.e. an install without those
extras. CI passes a venv that really has only the core dependencies as ``KVROUTE_BARE_PYTHON`` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, cwd=out)
    (whl,) = out.glob("kvroute-*.whl")
    return whl


def install_wheel(wheel: Path, env_dir: Path) -> Path:
    """A fresh venv at ``env_dir`` with the wheel and nothing else; returns its python."""
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    return py


def _top_level(entry: str) -> str:
    """``sqlalchemy`` for ``sqlalchemy/``, ``SQLAlchemy-2.1.9.dist-info`` and ``typing_extensions.py``."""
    return entry.split("-", 1)[0].split(".", 1)[0].lower()


def filtered_site(dest: Path, blocked: Iterable[str]) -> Path:
    """Links to every entry of this environment's site-packages except ``blocked`` modules and kvroute itself."""
    if dest.exists():
        return dest
    skip = {*blocked, "kvroute"}
    dest.mkdir(parents=True)
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.suffix == ".pth" or _top_level(entry.name) in skip or entry.name.startswith("__editable__"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def bare_env(py: Path, site: Path | None) -> dict[str, str]:
    """The environment to run ``py`` with: only ``site`` on PYTHONPATH, no KVROUTE_* settings of this shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_") and k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env
