"""Shared fixtures for plugin tests: a real redis-server on 127.0.0.1 (or the one CI gives)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from loopback import REDIS, RedisServer


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """KVROUTE_TEST_REDIS_URL when CI provides one, else a redis-server we start, else skip."""
    url = os.environ.get("KVROUTE_TEST_REDIS_URL")
    if url:
        yield url
        return
    if REDIS is None:
        pytest.skip("no Redis: set KVROUTE_TEST_REDIS_URL or install redis-server (apt-get install redis-server)")
    server = RedisServer(REDIS)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server this test may kill (needs the binary even when CI gives a URL)."""
    if REDIS is None:
        pytest.skip("the outage tests need the redis-server binary (apt-get install redis-server)")
    server = RedisServer(REDIS)
    server.start()
    try:
        yield server
    finally:
        server.stop()
