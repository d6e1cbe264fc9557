"""``SessionStarts``: a session's first request, told apart by its key."""

from __future__ import annotations

import pytest

from kvroute.policies.sessions import SessionStarts


def test_first_is_true_once_per_remembered_key_and_never_without_one():
    starts = SessionStarts(2)
    assert starts.first("a") and not starts.first("a")
    assert starts.first("b")
    assert not starts.first("a")  # a lookup marks "a" recently seen, so "b" is forgotten first
    assert starts.first("c")
    assert starts.first("b")
    assert starts.first("a")  # the least recently seen when "b" came back
    assert not starts.first(None)


def test_capacity_zero_tells_nothing_apart_and_negative_is_refused():
    assert not SessionStarts(0).first("a")
    with pytest.raises(ValueError, match="capacity"):
        SessionStarts(-1)
