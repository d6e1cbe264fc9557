"""The hash secret: from settings, else shared through Redis (SET NX), else a 0600 file; all workers agree."""

from __future__ import annotations

import stat
import subprocess
import sys
import uuid

import pytest

from kvroute.plugin.hash_secret import SECRET_FILE, file_secret, resolve_chain_key
from kvroute.plugin.shared_state import SharedStateConfig, shared_secret
from kvroute.policies.errors import ConfigError


def test_settings_secret_wins(tmp_path):
    key, source = resolve_chain_key("s" * 20, "redis://unused", tmp_path, share=lambda *_: pytest.fail("asked"))
    assert source == "settings" and key.secret == b"s" * 20
    assert not (tmp_path / SECRET_FILE).exists()


def test_file_secret_is_created_once_with_mode_0600_and_reused(tmp_path):
    first = file_secret(tmp_path / "data")
    path = tmp_path / "data" / SECRET_FILE
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert file_secret(tmp_path / "data") == first
    key, source = resolve_chain_key(None, None, tmp_path / "data")
    assert source == "file" and key.secret == first


def test_concurrent_workers_creating_the_file_agree(tmp_path):
    code = "import sys; from kvroute.plugin.hash_secret import file_secret; print(file_secret(sys.argv[1]).hex())"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(outs) == 1 and len(next(iter(outs))) == 64


def test_a_truncated_secret_file_is_a_named_error(tmp_path):
    (tmp_path / SECRET_FILE).write_bytes(b"abc")
    with pytest.raises(ConfigError) as err:
        file_secret(tmp_path)
    assert err.value.key == "kvroute.data_dir"


def test_redis_shares_the_first_secret_with_every_later_worker(redis_url, tmp_path):
    cfg = SharedStateConfig(namespace=f"kvtest-{uuid.uuid4().hex[:8]}")
    first = shared_secret(redis_url, b"A" * 32, cfg)
    assert first == b"A" * 32
    assert shared_secret(redis_url, b"B" * 32, cfg) == first  # SET NX: a later worker adopts the first one
    key, source = resolve_chain_key(None, redis_url, tmp_path, share=lambda url, c: shared_secret(url, c, cfg))
    assert source == "redis" and key.secret == first and not (tmp_path / SECRET_FILE).exists()


def test_unreachable_redis_falls_back_to_the_file(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = SharedStateConfig(socket_timeout_s=0.3)
    key, source = resolve_chain_key(None, f"redis://127.0.0.1:{port}/0", tmp_path,
                                    share=lambda url, c: shared_secret(url, c, cfg))
    assert source == "file" and key.secret == file_secret(tmp_path)
