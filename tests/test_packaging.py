"""The wheel ships policies/, plugin/, billing/, sim/ as kvroute.* and nothing at the top level."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_helpers import build_wheel, filtered_site, install_wheel

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("policies", "plugin", "billing", "sim")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
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
    assert "kvroute = kvroute.plugin.cli.cli:main" in entry


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    py = install_wheel(wheel, env_dir)
    # Dependencies come from the test environment's site-packages (no network needed); kvroute itself
    # must come from the fresh venv, not from this checkout or this environment's own install.
    deps = str(filtered_site(tmp_path / "site", ()))
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


# --- extras: pinned as tested, each works on its own, the core stays small ---------------------------------------

def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


REQUIREMENTS = ROOT / "requirements"
HASHED = sorted(REQUIREMENTS.rglob("*.txt"))  # every file pip installs from: the lock, its subsets, tools, bench


def _entries(path: Path) -> list[tuple[str, str, list[str]]]:
    """A hashed requirements file as (requirement, version, hashes) per entry (``\\`` continuations joined)."""
    from packaging.requirements import Requirement

    logical = path.read_text().replace("\\\n", " ")
    out = []
    for line in logical.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        hashes = [w.removeprefix("--hash=") for w in words if w.startswith("--hash=")]
        req = Requirement(" ".join(w for w in words if not w.startswith("--")))
        (spec,) = req.specifier
        out.append((str(req), spec.version, hashes))
    return out


def _lock(path: Path = REQUIREMENTS / "lock.txt") -> dict[str, str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return {canonicalize_name(Requirement(req).name): version for req, version, _ in _entries(path)}


def _requirements(extra: str | None = None) -> list:
    from packaging.requirements import Requirement

    project = _pyproject()["project"]
    raw = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(r) for r in raw]


def test_every_pin_is_the_tested_version_from_the_lock_file():
    from packaging.utils import canonicalize_name

    lock = _lock()
    extras = [None, *_pyproject()["project"]["optional-dependencies"]]
    for extra in extras:
        for req in _requirements(extra):
            if req.name == "kvroute":
                continue
            (spec,) = req.specifier
            assert spec.operator == "==", f"{extra}: {req} is not pinned"
            assert lock.get(canonicalize_name(req.name)) == spec.version, f"{extra}: {req} but lock has " \
                f"{lock.get(canonicalize_name(req.name))}"


def test_extras_match_what_the_cli_checks_and_all_holds_them_all():
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    from kvroute.plugin.extras import EXTRAS

    declared = set(_pyproject()["project"]["optional-dependencies"]) - {"dev", "all"}
    assert set(EXTRAS) == declared
    (everything,) = _requirements("all")
    assert everything.name == "kvroute" and everything.extras == declared - {"litellm"}
    assert {r.name for r in _requirements("proxy") if r.name == "kvroute"} and \
        next(r for r in _requirements("proxy") if r.name == "kvroute").extras == {"litellm"}
    providers = packages_distributions()
    for extra, modules in EXTRAS.items():
        names = {canonicalize_name(r.name) for r in _requirements(extra)}
        if extra == "proxy":
            names |= {canonicalize_name(r.name) for r in _requirements("litellm")}
        for module in modules:
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            assert dists & names, f"module {module} of extra {extra!r} comes from {dists}, not from {names}"


def test_proxy_extra_holds_litellm_own_proxy_requirements():
    """LiteLLM's `proxy` extra minus litellm-proxy (not on PyPI) and with the releases that exist."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ours = {canonicalize_name(r.name) for r in [*_requirements("proxy"), *_requirements()]}
    theirs = set()
    for raw in requires("litellm") or []:
        req = Requirement(raw)
        if req.marker is not None and req.marker.evaluate({"extra": "proxy"}) \
                and not req.marker.evaluate({"extra": ""}):
            theirs.add(canonicalize_name(req.name))
    missing = theirs - ours - {"litellm-proxy"}
    assert not missing, missing


def test_core_dependencies_stay_small():
    names = {r.name.lower() for r in _requirements()}
    assert len(names) <= 10
    assert not names & {"litellm", "openai", "sqlalchemy", "pyzmq", "redis", "fastapi", "numpy", "matplotlib"}


@pytest.mark.parametrize("path", HASHED, ids=lambda p: p.relative_to(REQUIREMENTS).as_posix())
def test_every_locked_file_is_pinned_and_hashed(path):
    """pip's --require-hashes needs ``==`` and a sha256 on every entry; a package asked for with an extra
    (``httpx[http2]``) is pinned under that name and under its own."""
    from packaging.requirements import Requirement

    entries = _entries(path)
    assert entries, path
    for req, version, hashes in entries:
        assert f"=={version}" in req, req
        assert hashes and all(h.startswith("sha256:") and len(h) == 71 for h in hashes), req
    names = {Requirement(req).name.lower() for req, _, _ in entries}
    for req, _, _ in entries:
        parsed = Requirement(req)
        if parsed.extras:
            assert parsed.name.lower() in names, f"{path.name}: {req} has no plain pin beside it"


def test_the_subsets_pin_the_lock_files_versions():
    lock = _lock()
    for name in ("proxy.txt", "core.txt", "dev.txt"):
        differ = {k: (v, lock.get(k)) for k, v in _lock(REQUIREMENTS / name).items() if lock.get(k) != v}
        assert not differ, f"{name} differs from lock.txt: {differ}"


def test_every_install_in_the_docs_and_ci_requires_hashes():
    """Every pip install of a requirements file checks hashes; kvroute itself goes in with --no-deps."""
    import re

    for source in ("README.md", "docs/proxy.md", ".ci/run", "tests/run.sh"):
        for line in (ROOT / source).read_text().splitlines():
            for install in re.findall(r"pip\S* install [^&;|#]*", line):
                assert "--require-hashes -r " in install or "--no-deps" in install, f"{source}: {line.strip()}"


def test_every_requirements_file_that_is_named_exists():
    import re

    for source in ("pyproject.toml", "README.md", ".ci/run", "tests/run.sh", "docs/proxy.md", "bench/peer_routers.py"):
        for path in re.findall(r"requirements/[\w./-]+\.txt", (ROOT / source).read_text()):
            assert (ROOT / path).is_file(), f"{source} names {path}, which does not exist"


@pytest.mark.slow
def test_sdist_holds_the_code_and_builds_the_same_wheel(wheel, tmp_path):
    import tarfile

    from setuptools import build_meta

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(cwd)
    sdist = tmp_path / name
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    for folder in CODE_DIRS:
        assert any(f"/{folder}/__init__.py" in m for m in members), folder
    out = tmp_path / "from-sdist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(sdist)], check=True, cwd=tmp_path)
    (rebuilt,) = out.glob("kvroute-*.whl")
    assert sorted(zipfile.ZipFile(rebuilt).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())


def test_reference_page_documents_every_price_file_and_event_field():
    from kvroute.billing import events, price_file
    from kvroute.billing.pricing import SURCHARGE_BUCKETS

    text = (ROOT / "docs" / "reference.md").read_text()
    fields = {*price_file.RULE_FIELDS, *price_file.RATE_FIELDS, *price_file.RATE_SOURCES, *SURCHARGE_BUCKETS,
              *events._KNOWN, *events.STATUSES, *events.ROUTE_KINDS, "platform_fee_pct", "payment_fee_pct",
              "effective_from", "gpu_hour", "tokens_per_s", "served_model", "route_kind", "endpoint"}
    missing = sorted(f for f in fields if f"`{f}`" not in text)
    assert not missing, missing


@pytest.mark.slow
def test_the_test_run_silences_third_party_warnings(tmp_path):
    """A test that builds a LiteLLM Router (pydantic's ReadOnly warnings, LiteLLM's deprecations) warns nothing."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import litellm\n\n\ndef test_router():\n"
                     "    router = litellm.Router(model_list=[{'model_name': 'm', 'litellm_params': "
                     "{'model': 'openai/m', 'api_key': 'x', 'mock_response': 'hi'}}])\n"
                     "    assert router.completion(model='m', messages=[{'role': 'user', 'content': 'hi'}])\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                          str(tmp_path), str(probe)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 passed" in out.stdout and "warning" not in out.stdout.lower(), out.stdout[-3000:]
