#!/usr/bin/env bash
# Run the whole kvroute test suite on this machine.
# Creates .venv with the locked, hash-checked dependencies, starts a throw-away PostgreSQL and Redis on 127.0.0.1
# (when their binaries exist and no KVROUTE_TEST_PG_URL / KVROUTE_TEST_REDIS_URL is given), runs pytest,
# and stops what it started. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export LITELLM_LOCAL_MODEL_COST_MAP=True
PYTHON=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --require-hashes -r requirements/lock.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

work=$(mktemp -d /tmp/kvroute-test.XXXXXX)
chmod 755 "$work"
pids=()
cleanup() {
  if [ -n "${PGDATA_DIR:-}" ]; then
    as_pg "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -m immediate stop >/dev/null 2>&1 || true
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "${KVROUTE_TEST_PG_URL:-}" ] && [ -n "$PGBIN" ] && { [ "$(id -u)" != 0 ] || id postgres >/dev/null 2>&1; }; then
  PGDATA_DIR="$work/pg"
  mkdir -p "$PGDATA_DIR" && { [ "$(id -u)" != 0 ] || chown postgres "$PGDATA_DIR"; }
  port=$(free_port)
  as_pg "$PGBIN/initdb" -D "$PGDATA_DIR" -U kvroute --auth=trust >/dev/null
  as_pg "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -o "-c listen_addresses=127.0.0.1 -p $port -k $PGDATA_DIR -c fsync=off" \
    -l "$PGDATA_DIR/log" -w start >/dev/null
  as_pg "$PGBIN/createdb" -h 127.0.0.1 -p "$port" -U kvroute kvroute_test
  export KVROUTE_TEST_PG_URL="postgresql+psycopg://kvroute@127.0.0.1:$port/kvroute_test"
  echo "PostgreSQL for tests: 127.0.0.1:$port"
fi

if [ -z "${KVROUTE_TEST_REDIS_URL:-}" ] && command -v redis-server >/dev/null; then
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    --dir "$work" >"$work/redis.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  export KVROUTE_TEST_REDIS_URL="redis://127.0.0.1:$port/0"
  echo "Redis for tests: 127.0.0.1:$port"
fi

.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
