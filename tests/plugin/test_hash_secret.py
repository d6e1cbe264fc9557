"""The hash secret: from settings or a secret file (required with Redis, never stored there), else a 0600 file."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from kvroute.plugin.settings import load_settings
from kvroute.plugin.state.hash_secret import SECRET_FILE, file_secret, fingerprint, resolve_chain_key
from kvroute.policies.errors import ConfigError
from kvroute.policies.fingerprint import ChainKey


def test_settings_secret_wins(tmp_path):
    key, source = resolve_chain_key("s" * 20, "redis://unused", tmp_path)
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
    code = "import sys; from kvroute.plugin.state.hash_secret import file_secret; print(file_secret(sys.argv[1]).hex())"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(outs) == 1 and len(next(iter(outs))) == 64


def test_a_truncated_secret_file_is_a_named_error(tmp_path):
    (tmp_path / SECRET_FILE).write_bytes(b"abc")
    with pytest.raises(ConfigError) as err:
        file_secret(tmp_path)
    assert err.value.key == "kvroute.data_dir"


def test_shared_state_without_a_secret_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_chain_key(None, "redis://127.0.0.1:6379/0", tmp_path)
    assert err.value.key == "kvroute.hash_secret" and "never stored in Redis" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / SECRET_FILE).exists()


def test_a_secret_file_is_read_and_checked(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"s" * 24 + b"\n")
    key, source = resolve_chain_key(None, "redis://127.0.0.1:6379/0", tmp_path, path)
    assert source == "secret_file" and key.secret == b"s" * 24
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError) as err:
        resolve_chain_key(None, "redis://127.0.0.1:6379/0", tmp_path, path)
    assert err.value.key == "kvroute.hash_secret_file"
    with pytest.raises(ConfigError) as err:
        resolve_chain_key(None, None, tmp_path, tmp_path / "missing")
    assert err.value.key == "kvroute.hash_secret_file"


def test_the_fingerprint_agrees_exactly_when_the_secrets_do():
    a, b = ChainKey(b"a" * 32), ChainKey(b"b" * 32)
    assert fingerprint(a) == fingerprint(ChainKey(b"a" * 32)) != fingerprint(b)
    assert len(fingerprint(a)) == 16 and fingerprint(ChainKey()) == "unkeyed"
    assert b"a" * 32 not in bytes.fromhex(fingerprint(a))


def test_os_environ_reference_gives_the_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_KVROUTE_SECRET", "from-the-environment-0123")
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("kvroute: {hash_secret: os.environ/MY_KVROUTE_SECRET, redis_url: 'redis://127.0.0.1:1/0'}\n")
    s = load_settings(cfg)
    key, source = resolve_chain_key(s.hash_secret.get_secret_value(), s.redis_url, tmp_path, s.hash_secret_file)
    assert source == "settings" and key.secret == b"from-the-environment-0123"
