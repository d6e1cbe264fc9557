#!/usr/bin/env bash
# The fast lane: ruff, then every test but the e2e and slow ones (about two minutes on a 2-core machine).
# No installs and no services of its own (run the README's set-up command once; billing tests start a
# throw-away PostgreSQL themselves when initdb is installed, Redis tests skip without redis-server).
# Extra arguments go to pytest. The whole suite: bash tests/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export LITELLM_LOCAL_MODEL_COST_MAP=True
if [ ! -x .venv/bin/python ]; then
  echo "tests/fast.sh: no .venv here; run the set-up command at the top of README.md first" >&2
  exit 2
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -m "not e2e and not slow" -q "$@"
