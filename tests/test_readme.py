"""The README's quick starts, run as the page writes them, in a copy of this work tree as a fresh clone has it.

Every block comes from README.md through ``readme_blocks`` (markdown-it-py), so an edit of the page is an edit of
this test; the only change made to a block is its port numbers, swapped for free ones (and the example's
``EXAMPLE_*`` URLs set to those ports, which ``examples/env.sh`` allows). In order:

1. the first command (a venv from ``requirements/lock.txt`` with hashes required, kvroute with ``--no-deps``,
   ``kvroute demo``) in the copy; its second line is what ``.ci/run`` runs;
2. the proxy install block in another fresh venv (``requirements/proxy.txt``), which every later block runs from;
3. the config block written to ``config.yaml`` and the check-and-start block against one fake engine, until
   the proxy is ready and logs its startup line;
4. the example: fake engines, ``kvroute wait``, ``check --live``, the proxy, prices, the same request twice with
   curl, the margin report; then the cost-per-customer command the page gives inline.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from readme_blocks import README, ROOT, BlockRun, section, with_ports

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

sys.path.insert(0, str(ROOT / "tests" / "plugin"))
from test_examples_proxy import NetworkRecorder  # noqa: E402

PROXY_HEADING = "Add kvroute to your LiteLLM proxy"


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """This machine's environment without this test's venv or kvroute settings (``venv``'s bin first if given)."""
    own = str(Path(sys.prefix) / "bin")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != own]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTE_", "EXAMPLE_", "REPLICA_"))
           and k not in ("VIRTUAL_ENV", "PYTHONPATH", "LITELLM_MASTER_KEY")}
    return {**env, "PATH": os.pathsep.join(path)}


def run(text: str, cwd: Path, env: dict[str, str], logs: Path, timeout: float) -> BlockRun:
    logs.mkdir(parents=True, exist_ok=True)
    with BlockRun(text, cwd, env, logs) as block:
        code = block.wait(timeout)
    assert code == 0, f"exit {code}:\n{block.output()[-4000:]}"
    return block


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The work tree's files as a clone has them (tracked and new, nothing ignored: no .venv, no ledger)."""
    dest = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def proxy_venv(clone, tmp_path_factory) -> Path:
    """A fresh venv with the README's proxy install block run in it, from the clone."""
    (install,) = [b for b in section(PROXY_HEADING) if b.info == "sh" and "pip install" in b.text]
    venv = clone / "proxy-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    run(install.text, clone, clean_env(venv), tmp_path_factory.mktemp("install-logs"), timeout=900)
    return venv


def test_the_first_command_installs_with_hashes_and_runs_the_demo(clone, tmp_path):
    (first, *_) = section("kvroute")
    install_and_demo, tests = first.text.splitlines()
    assert "--require-hashes -r requirements/lock.txt" in install_and_demo
    assert tests in (ROOT / ".ci" / "run").read_text()  # the README's test command is what CI runs
    block = run(install_and_demo, clone, clean_env(), tmp_path, timeout=900)
    out = block.stdout
    share = re.search(r"cached-token share\s*│\s*([\d.]+)%\s*│\s*([\d.]+)%", out)
    assert share and float(share[1]) > float(share[2]), out
    assert re.search(r"failed\s*│\s*0\s*│\s*0\s*│", out), out


def test_the_config_block_checks_and_starts_a_proxy(clone, proxy_venv, tmp_path):
    blocks = section(PROXY_HEADING)
    (config,) = [b for b in blocks if b.info == "yaml"]
    (start,) = [b for b in blocks if b.info == "sh" and "config.yaml --live" in b.text and "examples/" not in b.text]
    (tmp_path / "config.yaml").write_text(config.text)
    port = free_port()
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=200000, decode_ms=0.0, slots=4)
    with NetworkRecorder() as recorder, Fleet(1, engine="fake", options=opts) as replica:
        env = {**clean_env(proxy_venv), **recorder.env(), "REPLICA_1_API_BASE": replica.base_urls[0] + "/v1",
               "REPLICA_1_METRICS_URL": replica.base_urls[0] + "/metrics",
               "LITELLM_MASTER_KEY": "sk-readme-" + secrets.token_hex(16)}
        with BlockRun(with_ports(start.text, {4000: port}), tmp_path, env, tmp_path) as block, \
                httpx.Client(trust_env=False, timeout=2) as client:
            def ready() -> bool:
                try:
                    return client.get(f"http://127.0.0.1:{port}/health/readiness").status_code == 200
                except httpx.HTTPError:
                    return False

            block.wait_until(ready, timeout=180)
            out = block.output()
    assert "config.yaml: ok (1 groups: llama; 1 self-hosted, 0 hosted deployments)" in out, out[-3000:]
    assert re.search(r"^ok   replica-1 api_base: .* answers 200$", out, re.M), out[-3000:]
    assert "kvroute ready: groups llama (cache_aware, approx, 1 self-hosted; metrics scraped)" in out, out[-3000:]
    assert recorder.requests == []


def test_the_example_runs_as_written(clone, proxy_venv, tmp_path):
    (example,) = [b for b in section(PROXY_HEADING) if "examples/config.yaml" in b.text and "curl" in b.text]
    ports = {p: free_port() for p in (8001, 8002, 8003, 8101, 8102, 4000)}
    text = with_ports(example.text, ports)
    urls = {f"EXAMPLE_REPLICA_{i}_API_BASE": f"http://127.0.0.1:{ports[8000 + i]}/v1" for i in (1, 2, 3)}
    urls |= {f"EXAMPLE_REPLICA_{i}_METRICS_URL": f"http://127.0.0.1:{ports[8000 + i]}/metrics" for i in (1, 2, 3)}
    urls |= {f"EXAMPLE_PROVIDER_{n}_API_BASE": f"http://127.0.0.1:{ports[p]}/v1" for n, p in (("A", 8101),
                                                                                             ("B", 8102))}
    (tmp_path / "examples").symlink_to(clone / "examples")
    with NetworkRecorder() as recorder:
        env = {**clean_env(proxy_venv), **recorder.env(), **urls}
        with BlockRun(text, tmp_path, env, tmp_path) as block:
            code = block.wait(timeout=300)
            out, everything = block.stdout, block.output()
            assert code == 0, everything[-4000:]
            by_customer = subprocess.run(["bash", "-c", per_customer_command()], cwd=tmp_path, env=env,
                                         capture_output=True, text=True, timeout=120)
    assert "ready: 8 URL(s) answer" in out and "ready: 1 URL(s) answer" in out, out
    assert "examples/config.yaml: ok (2 groups: hosted, llama; 3 self-hosted, 2 hosted deployments)" in out
    assert len(re.findall(r"^ok   \S+ (api_base|metrics_url): ", out, re.M)) == 8, out
    assert "backends +5, rate cards +5, price books +2" in out
    answers = [json.loads(line) for line in out.splitlines() if line.startswith('{"id"')]
    served = re.findall(r"^served by (\S+)$", out, re.M)
    assert len(answers) == 2 and len(served) == 2 and served[0] == served[1] and served[0].startswith("replica-")
    cached = [(a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for a in answers]
    assert cached[0] == 0 and cached[1] >= 256, cached  # the repeat finds the system prompt on its replica
    table = out[out.index("kvroute margin report"):]
    row = next(line for line in table.splitlines() if served[0] in line)
    assert "acme" in row and "TOTAL" in table and "UNPRICED" not in table, table
    assert "warning" not in everything and "Traceback" not in everything, everything[-3000:]
    assert by_customer.returncode == 0 and "customer-42" in by_customer.stdout, by_customer.stdout + by_customer.stderr
    assert recorder.requests == []


def per_customer_command() -> str:
    """The report command the README gives inline for cost per customer (``--by end_user``)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(README.read_text())
    codes = [child.content for tok in tokens if tok.type == "inline" for child in tok.children or []
             if child.type == "code_inline" and "--by end_user" in child.content]
    assert len(codes) == 1, codes
    return codes[0]
