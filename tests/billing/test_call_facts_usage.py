"""``event_from_facts`` reads an attempt's usage in whatever mapping a caller states it: the producers' plain
``as_mapping`` result without converting it again, and any other mapping (nested pydantic details included) made
plain once, so the bill and the archived raw usage agree with what the provider reported."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("litellm")

from litellm.types.utils import PromptTokensDetailsWrapper, Usage

from kvroute.billing.call_facts import CallFacts, event_from_facts
from kvroute.billing.usage import PlainUsage, as_mapping


def _event(usage):
    return event_from_facts(CallFacts(request_id="r1", app_id="app", served_model="m", usage=usage))


def test_a_caller_built_dict_with_pydantic_details_keeps_its_cached_tokens_and_archives_them_plain():
    usage = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
             "prompt_tokens_details": PromptTokensDetailsWrapper(cached_tokens=60)}
    e = _event(usage)
    assert (e.tokens.input_uncached, e.tokens.cache_read, e.tokens.output) == (40, 60, 5)
    archived = json.loads(e.to_bytes())["raw_usage"]
    assert archived["prompt_tokens_details"]["cached_tokens"] == 60  # a dict, not the object's repr


def test_the_producers_plain_usage_is_read_as_it_is_and_gives_the_same_event():
    response_usage = Usage(prompt_tokens=100, completion_tokens=5, total_tokens=105,
                           prompt_tokens_details=PromptTokensDetailsWrapper(cached_tokens=60))
    plain = as_mapping(response_usage)
    assert type(plain) is PlainUsage and type(plain["prompt_tokens_details"]) is PlainUsage
    from_plain, from_model_dict = _event(plain), _event(dict(response_usage))
    assert from_plain.tokens == from_model_dict.tokens
    assert (from_plain.tokens.cache_read, from_plain.tokens.input_uncached) == (60, 40)
    assert json.loads(from_plain.to_bytes())["raw_usage"] == json.loads(from_model_dict.to_bytes())["raw_usage"]


def test_any_session_and_tags_a_client_sends_make_a_valid_event():
    """Client strings are fitted, never refused: NUL, a lone surrogate, 300 characters, 30 tags, blanks."""
    tags = ("a\x00b", "\ud800", "", None, "t" * 300, *(f"tag{i:02d}" for i in range(30)))
    e = event_from_facts(CallFacts(request_id="r1", app_id="app", served_model="m", session_id="s" * 300,
                                   tags=tags))
    assert len(e.session_id) == 200 and len(e.tags) == 20 and all(0 < len(t) <= 100 for t in e.tags)
    assert list(e.tags) == sorted(set(e.tags)) and "a\ufffdb" in e.tags
    e.to_line().encode()  # valid UTF-8: the journal and both databases take it
