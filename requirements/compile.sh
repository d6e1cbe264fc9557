#!/usr/bin/env bash
# Regenerate every hashed requirements file here with uv (itself pinned and hashed in tools.txt):
#   python3 -m venv /tmp/lock-tools && /tmp/lock-tools/bin/pip install --require-hashes -r requirements/tools.txt
#   UV=/tmp/lock-tools/bin/uv bash requirements/compile.sh
# Each file pins one version per package for every platform and Python >= 3.11 (--universal), with the sha256 of
# every file the index serves for that version. uv keeps the versions an existing file pins: to move one, change
# its pin in pyproject.toml or an .in file, or pass --upgrade-package NAME (extra arguments go to every compile).
# lock.txt is what the tests run (every extra + dev); proxy.txt (the proxy and billing extras: a proxy, its
# ledger and reports) and core.txt are subsets of it at the same versions, with the build backend that
# `pip install --no-deps --no-build-isolation` of kvroute needs; dev.txt is the test tools over the core (beside
# proxy.txt in .ci/run's wheel check); tools.txt makes and audits the lock; bench/*.txt are the venvs of the
# peer routers (bench/peer_routers.py) and of py-spy.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}

# A dependency asking for `httpx[http2]` needs a pin of that name in pip's hash-checking mode, and one asking for
# plain `httpx` needs its own: each `name[extra]==version` entry is written twice, with and without the extra.
split_extras='
/^[A-Za-z0-9._-]+\[[^]]*\]==/ { block = $0; held = 1; if ($0 !~ /\\$/) flush(); next }
held { block = block "\n" $0; if ($0 !~ /\\$/) flush(); next }
{ print }
function flush(  plain) { print block; plain = block; sub(/\[[^]]*\]/, "", plain); print plain; held = 0 }'

compile() {
  local out=$1; shift
  "$UV" pip compile --quiet --generate-hashes --no-strip-extras --universal --python-version 3.11 \
    --custom-compile-command "bash requirements/compile.sh" -o "$out" "$@"
  awk "$split_extras" "$out" > "$out.tmp" && mv "$out.tmp" "$out"
}
compile requirements/lock.txt pyproject.toml --extra all --extra dev "$@"
compile requirements/proxy.txt pyproject.toml requirements/build.in --extra proxy --extra billing -c requirements/lock.txt "$@"
compile requirements/core.txt pyproject.toml requirements/build.in -c requirements/lock.txt "$@"
compile requirements/dev.txt pyproject.toml requirements/build.in --extra dev -c requirements/lock.txt "$@"
compile requirements/tools.txt requirements/tools.in "$@"
for router in requirements/bench/*.in; do
  compile "${router%.in}.txt" "$router" "$@"
done
