"""The decision log through a real proxy: a failed attempt leaves one ``ended`` line beside the picks.

One fake replica answers its next request 500; LiteLLM retries it (the same replica, the only one) and the client is
served. The log (``KVROUTE_DECISION_LOG``) then holds two picks for the request's call id and, between them, the
first attempt's ending: how, backend, the one verdict and the exception's class chain, no prompt text.
"""

from __future__ import annotations

import json

import pytest
from logged_proxy import chat, fault, logged_proxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "a prompt the log must never hold"


@pytest.mark.timeout(300)
def test_a_retried_attempt_leaves_its_ending_and_why(tmp_path):
    log = tmp_path / "decisions.jsonl"
    with logged_proxy(1, log, capacity_tokens=8192) as (fleet, proxy):
        fault(fleet, 0, "500")
        r = chat(proxy, [{"role": "user", "content": SECRET * 20}], "call-retried")
        assert r.status_code == 200, r.text
    text = log.read_text()
    assert SECRET not in text
    lines = [json.loads(line) for line in text.splitlines()]
    mine = [line for line in lines if line.get("call_id") == "call-retried"]
    picks = [line for line in mine if "event" not in line]
    (ended,) = [line for line in mine if line.get("event") == "ended"]
    assert [p["backend"] for p in picks] == ["llama-0", "llama-0"]  # the attempt and its retry
    assert ended["how"] == "failed" and ended["backend"] == "llama-0" and ended["request_id"] == picks[0]["request_id"]
    assert ended["blames_backend"] is True and ended["http_status"] == 500 and ended["verdict"]
    assert ended["error"] and all("." in name for name in ended["error"])  # class names only
    assert mine.index(picks[0]) < mine.index(ended) < mine.index(picks[1])
