"""Audit a hashed requirements file for known vulnerabilities with pip-audit, or say why it could not.

``python .ci/audit_lock.py requirements/lock.txt`` (the python of a venv holding requirements/tools.txt) asks
each advisory source pip-audit knows in turn (PyPI's JSON API, then OSV) and reports the first that answers for
at least one package. Exit 1 when a locked package has a known vulnerability; exit 0, with one line saying so,
when no source answered (a closed network is not a finding).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

SERVICES = ("pypi", "osv")


def audit(lock: str, service: str) -> dict | None:
    """pip-audit's JSON for ``lock`` from ``service``; None when the run failed before producing it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "audit.json"
        cmd = [sys.executable, "-m", "pip_audit", "-r", lock, "--require-hashes", "--disable-pip", "-s", service,
               "-f", "json", "-o", str(out), "--progress-spinner", "off"]
        subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        return json.loads(out.read_text()) if out.exists() and out.stat().st_size else None


def main(lock: str) -> int:
    tried = []
    for service in SERVICES:
        report = audit(lock, service)
        deps = (report or {}).get("dependencies", [])
        audited = [d for d in deps if "skip_reason" not in d]
        if not audited:
            tried.append(f"{service}: " + ("no answer" if report is None else f"0 of {len(deps)} packages known"))
            continue
        found = [f"{d['name']} {d['version']}: {v['id']} (fixed in {', '.join(v.get('fix_versions') or ['-'])})"
                 for d in audited for v in d.get("vulns", [])]
        print(f"audit of {lock} ({service}): {len(audited)} of {len(deps)} packages checked, "
              f"{len(found)} known vulnerabilities")
        for line in found:
            print("  " + line)
        return 1 if found else 0
    print(f"audit of {lock} skipped: no advisory source reachable ({'; '.join(tried)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
