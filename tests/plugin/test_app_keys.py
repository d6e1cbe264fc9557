"""``kvroute.apps``: each listed key is one app's (kept as sha256 only); bad entries are one line naming the key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvroute.plugin.adapter.key_hashes import app_of, key_hash
from kvroute.plugin.settings import load_settings
from kvroute.policies.errors import ConfigError


def _write(tmp_path: Path, block: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("kvroute:\n  apps:\n" + block)
    return path


def test_keys_from_the_environment_or_as_hashes_map_to_their_app(tmp_path, monkeypatch):
    monkeypatch.setenv("ACME_KEY", "sk-acme-1")
    beta_hash = hashlib.sha256(b"sk-beta-1").hexdigest()
    s = load_settings(_write(tmp_path, f"    acme: {{keys: [os.environ/ACME_KEY]}}\n"
                                       f"    beta: {{keys: ['sha256:{beta_hash.upper()}']}}\n"))
    assert app_of("sk-acme-1", s.app_keys) == "acme" and app_of("sk-beta-1", s.app_keys) == "beta"
    assert app_of("sk-kvroute-local", s.app_keys) is None and app_of("", s.app_keys) is None
    assert "sk-acme-1" not in repr(s) and "sk-acme-1" not in str(s.model_dump())  # only hashes are kept
    assert s.apps["acme"].keys == [key_hash("sk-acme-1")] == ["sha256:" + hashlib.sha256(b"sk-acme-1").hexdigest()]


@pytest.mark.parametrize(("block", "message"), [
    ("    acme: {keys: [os.environ/KVROUTE_TEST_UNSET_KEY]}\n",
     "kvroute.apps.acme.keys: keys[0] is empty (an os.environ/ variable that is not set?)"),
    ("    acme: {keys: ['sha256:abc']}\n", "kvroute.apps.acme.keys: keys[0] is not sha256:<64 hex digits>"),
    ("    acme: {keys: [os.environ/ACME_KEY]}\n    beta: {keys: [os.environ/ACME_KEY]}\n",
     "kvroute.apps: one key is listed under both 'acme' and 'beta'"),
    ("    acme: {key: [x]}\n", "kvroute.apps.acme.key: unknown key (did you mean keys?)"),
])
def test_a_bad_entry_is_one_line_naming_the_key(tmp_path, monkeypatch, block, message):
    monkeypatch.setenv("ACME_KEY", "sk-acme-1")
    monkeypatch.delenv("KVROUTE_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(_write(tmp_path, block))
    assert str(err.value) == message and "sk-acme-1" not in str(err.value)
