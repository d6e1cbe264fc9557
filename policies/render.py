"""Canonical rendering of OpenAI-style requests into byte segments, in the order an engine sees them.

The renderer never raises: anything it cannot interpret is rendered through a safe, deterministic
fallback (``repr`` of its type and a digest-free placeholder) and noted in ``RenderResult.notes``.
Prompt text is only ever held in memory for hashing; nothing here stores or logs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Separators are bytes that cannot occur in UTF-8 text, so message and part boundaries never collide
# with content (0xFE/0xFF are invalid in UTF-8).
ROLE_START = b"\xfe"
PART_SEP = b"\xff"
MAX_JSON_DEPTH = 64


@dataclass(slots=True)
class RenderResult:
    """Byte segments of the canonical prompt plus the kind of input and anything that was odd."""

    segments: list[bytes] = field(default_factory=list)
    kind: str = "empty"
    token_ids: Sequence[int] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.segments)


def to_bytes(text: Any) -> bytes:
    """Encode text as UTF-8, keeping lone surrogates (``surrogatepass``) so no input can fail."""
    if isinstance(text, str):
        return text.encode("utf-8", "surrogatepass")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    if text is None:
        return b""
    return _canonical_json(text)


def _depth_limited(value: Any, depth: int = 0) -> Any:
    if depth >= MAX_JSON_DEPTH:
        return "<depth-limit>"
    if isinstance(value, Mapping):
        return {str(k): _depth_limited(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_depth_limited(v, depth + 1) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "surrogateescape")
    return f"<{type(value).__name__}>"


def _canonical_json(value: Any) -> bytes:
    """Sorted-key compact JSON; deep or exotic structures are cut at a fixed depth instead of failing."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    except (RecursionError, ValueError, TypeError):
        text = json.dumps(_depth_limited(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def _render_part(part: Any, out: list[bytes]) -> None:
    """One multi-part content item: text as text, media by reference (URL, id or its data)."""
    if isinstance(part, str):
        out.append(to_bytes(part))
        return
    if not isinstance(part, Mapping):
        out.append(to_bytes(part))
        return
    ptype = part.get("type")
    if ptype in ("text", "input_text", "output_text") or (ptype is None and "text" in part):
        out.append(to_bytes(part.get("text")))
    elif ptype in ("image_url", "input_image"):
        ref = part.get("image_url", part.get("file_id", ""))
        if isinstance(ref, Mapping):
            ref = ref.get("url", "")
        out.append(b"image:" + to_bytes(ref))
    elif ptype in ("input_audio", "audio"):
        audio = part.get("input_audio") or part.get("audio") or {}
        data = audio.get("data", audio.get("id", "")) if isinstance(audio, Mapping) else audio
        out.append(b"audio:" + to_bytes(data))
    elif ptype in ("file", "input_file"):
        ref = part.get("file") or part.get("file_id") or part.get("file_data") or ""
        out.append(b"file:" + to_bytes(ref))
    else:
        out.append(_canonical_json(part))


def _render_content(content: Any, out: list[bytes]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        out.append(to_bytes(content))
    elif isinstance(content, (list, tuple)):
        for i, part in enumerate(content):
            if i:
                out.append(PART_SEP)
            _render_part(part, out)
    else:
        _render_part(content, out)


def _render_message(msg: Any, out: list[bytes], notes: list[str]) -> None:
    if not isinstance(msg, Mapping):
        notes.append("non_mapping_message")
        out.append(ROLE_START + b"unknown" + PART_SEP)
        out.append(to_bytes(msg))
        return
    role = msg.get("role")
    if not isinstance(role, str):
        notes.append("unknown_role")
        role = "unknown"
    out.append(ROLE_START + to_bytes(role) + PART_SEP)
    if msg.get("name"):
        out.append(b"name:" + to_bytes(msg.get("name")) + PART_SEP)
    _render_content(msg.get("content"), out)
    tool_calls = msg.get("tool_calls")
    if tool_calls:
        for call in tool_calls if isinstance(tool_calls, (list, tuple)) else [tool_calls]:
            out.append(PART_SEP + b"call:")
            if isinstance(call, Mapping):
                fn = call.get("function") or {}
                if isinstance(fn, Mapping):
                    out.append(to_bytes(fn.get("name")) + PART_SEP + to_bytes(fn.get("arguments")))
                else:
                    out.append(_canonical_json(call))
            else:
                out.append(to_bytes(call))
    if msg.get("function_call"):
        out.append(PART_SEP + b"call:" + _canonical_json(msg.get("function_call")))
    if msg.get("tool_call_id"):
        out.append(PART_SEP + b"result:" + to_bytes(msg.get("tool_call_id")))


def _render_tools(tools: Any, out: list[bytes]) -> None:
    # Tool order is kept: chat templates render tools in the order given, so reordering breaks reuse.
    out.append(ROLE_START + b"tools" + PART_SEP)
    if isinstance(tools, (list, tuple)):
        for tool in tools:
            out.append(_canonical_json(tool))
            out.append(PART_SEP)
    else:
        out.append(_canonical_json(tools))


def render_request(kwargs: Mapping[str, Any]) -> RenderResult:
    """Render chat ``messages``, ``tools``/``functions``, completion ``prompt`` or Responses ``input``."""
    result = RenderResult()
    out = result.segments
    tools = kwargs.get("tools") or kwargs.get("functions")
    if tools:
        _render_tools(tools, out)
    messages = kwargs.get("messages")
    prompt = kwargs.get("prompt")
    resp_input = kwargs.get("input")
    instructions = kwargs.get("instructions")
    if messages is not None:
        result.kind = "chat"
        if isinstance(messages, (list, tuple)):
            append = out.append
            notes = result.notes
            for msg in messages:  # engines render turns in the order given
                # fast path, the same bytes as ``_render_message``: a plain {"role": str, "content": str} turn
                if type(msg) is dict and len(msg) == 2:
                    role = msg.get("role")
                    content = msg.get("content")
                    if type(role) is str and type(content) is str:
                        append(ROLE_START + role.encode("utf-8", "surrogatepass") + PART_SEP)
                        append(content.encode("utf-8", "surrogatepass"))
                        continue
                _render_message(msg, out, notes)
        else:
            result.notes.append("messages_not_a_list")
            _render_message({"role": "user", "content": messages}, out, result.notes)
    elif prompt is not None:
        result.kind = "completion"
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            result.token_ids = prompt
            result.kind = "tokens"
        elif isinstance(prompt, (list, tuple)) and len(prompt) == 1:
            _render_content(prompt[0], out)
        else:
            _render_content(prompt, out)
    elif resp_input is not None or instructions is not None:
        result.kind = "responses"
        if instructions:
            _render_message({"role": "system", "content": instructions}, out, result.notes)
        if isinstance(resp_input, str):
            _render_message({"role": "user", "content": resp_input}, out, result.notes)
        elif isinstance(resp_input, (list, tuple)):
            for item in resp_input:
                if isinstance(item, Mapping) and item.get("type") == "function_call_output":
                    _render_message(
                        {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")},
                        out,
                        result.notes,
                    )
                elif isinstance(item, Mapping) and item.get("type") == "function_call":
                    out.append(PART_SEP + b"call:" + to_bytes(item.get("name")) + PART_SEP)
                    out.append(to_bytes(item.get("arguments")))
                else:
                    _render_message(item, out, result.notes)
    elif not tools:
        result.notes.append("no_prompt")
    return result
