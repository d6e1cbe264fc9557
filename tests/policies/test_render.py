"""The chat fast path of ``render_request`` renders exactly the bytes ``_render_message`` does."""

from __future__ import annotations

from collections import UserDict

import pytest

from kvroute.policies.render import _render_message, render_request


class _Str(str):
    pass


MESSAGES = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "h\u00e9llo \ud800 lone surrogate"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": None},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]},
    {"role": "assistant", "content": "x", "name": "bot"},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
    {"role": 7, "content": "bad role"},
    {"role": "user"},
    {"content": "no role", "x": 1},
    {"role": _Str("user"), "content": _Str("subclassed strings")},
    UserDict({"role": "user", "content": "a mapping, not a dict"}),
    "not a mapping",
]


@pytest.mark.parametrize("msg", MESSAGES, ids=range(len(MESSAGES)))
def test_each_message_renders_as_the_general_path(msg: object) -> None:
    out: list[bytes] = []
    notes: list[str] = []
    _render_message(msg, out, notes)
    got = render_request({"messages": [msg]})
    assert got.segments == out
    assert got.notes == notes


def test_a_whole_chat_renders_as_the_general_path() -> None:
    out: list[bytes] = []
    notes: list[str] = []
    for msg in MESSAGES:
        _render_message(msg, out, notes)
    got = render_request({"messages": tuple(MESSAGES), "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert got.segments[-len(out):] == out
    assert got.notes == notes
    assert got.kind == "chat"
