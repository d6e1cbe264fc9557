"""Precise mode with tenant salts and keyed chains: request keys match the keys the index derives from
``BlockStored`` token ids (block 0 carrying the ``cache_salt`` the plugin sent) only for the same tenant."""

from __future__ import annotations

from kvroute.plugin.feeds.precise import PreciseGroup
from kvroute.policies.fingerprint import ChainKey, chain_seed
from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig

BS = 16
IDS = list(range(100, 100 + 6 * BS))


class FixedTokenizer:
    def encode(self, kwargs):
        return IDS


def test_precise_keys_follow_the_tenant_salt_and_ignore_a_client_salt_when_the_plugin_decides():
    chain = ChainKey(b"p" * 32)
    index = PreciseIndex(PreciseIndexConfig(chain=chain))
    index.attach("src", "A")
    # the engine stored the prompt under tenant salt "kvr-t1" (what the plugin sent as cache_salt)
    index.stored("src", list(range(1, 7)), None, IDS, BS, chain_seed("llama", "kvr-t1", index.chain))
    group = PreciseGroup("llama", index, tokenizer=FixedTokenizer(), block_size=BS)
    kwargs = {"messages": [{"role": "user", "content": "x"}], "cache_salt": "kvr-t1"}
    same = group.fingerprint(kwargs, salt="kvr-t1", tenant="team:a")
    other = group.fingerprint(kwargs, salt="kvr-t2", tenant="team:b")
    unsalted = group.fingerprint(kwargs, salt=None, tenant=None)  # the plugin said: no salt (client's ignored)
    assert index.match(same.keys, ["A"], 0.0) == {"A": 6}
    assert index.match(other.keys, ["A"], 0.0) == {}
    assert index.match(unsalted.keys, ["A"], 0.0) == {}
    assert group.fingerprint(kwargs).keys == same.keys  # a bare caller's cache_salt still counts
