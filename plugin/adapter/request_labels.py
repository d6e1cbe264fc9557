"""What a request says about itself in its metadata: its tags (routing rules, the ledger) and the session the
client names (the ledger; the keys session affinity reads). Read once per request; never prompt text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.policies.fingerprint import client_session

#: Metadata keys read for tags unless the settings say otherwise (``kvroute.tag_metadata_keys``).
DEFAULT_TAG_KEYS = ("workload", "tags")


def _raw_tags(metadata: Mapping[str, Any] | None, tag_keys: Sequence[str],
              request_tags_list: Sequence[Any] | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(scalar ``key: value`` pairs, list items) of the metadata keys ``tag_keys`` (and nested
    ``requester_metadata``) plus LiteLLM ``tags`` lists, in the order they were found."""
    sources: list[Mapping[str, Any]] = []
    if isinstance(metadata, Mapping):
        sources.append(metadata)
        nested = metadata.get("requester_metadata")
        if isinstance(nested, Mapping):
            sources.append(nested)
    scalars: list[tuple[str, str]] = []
    items: list[Any] = list(request_tags_list or [])
    for src in sources:
        for key in tag_keys:
            value = src.get(key)
            if value is None:
                continue
            if isinstance(value, list | tuple):
                items.extend(value)
            elif isinstance(value, str | int | float | bool):
                scalars.append((key, str(value)))
    return scalars, [item for item in items if isinstance(item, str)]


def request_tags(metadata: Mapping[str, Any] | None, tag_keys: Sequence[str],
                 request_tags_list: Sequence[Any] | None = None) -> dict[str, str]:
    """Flat ``{key: value}`` tags from request metadata (scalars only) and LiteLLM ``tags`` lists.

    A list tag ``"workload:batch"`` becomes ``{"workload": "batch"}``; a bare ``"batch"`` becomes
    ``{"batch": "true"}``. Metadata keys named in ``tag_keys`` are read, plus nested ``requester_metadata``.
    """
    scalars, items = _raw_tags(metadata, tag_keys, request_tags_list)
    out = dict(reversed(scalars))  # the first value of a key wins
    for item in items:
        if ":" in item:
            k, v = item.split(":", 1)
            out.setdefault(k.strip(), v.strip())
        else:
            out.setdefault(item.strip(), "true")
    return out


def ledger_tags(metadata: Mapping[str, Any] | None, tag_keys: Sequence[str]) -> tuple[str, ...]:
    """The request's tags as the ledger keeps them: every list item as written (``"team:a"``, ``"batch"``) and
    every scalar metadata tag as ``key:value``, stripped, sorted and unique (the ledger fits their length)."""
    scalars, items = _raw_tags(metadata, tag_keys, None)
    found = {f"{k}:{v}".strip() for k, v in scalars} | {item.strip() for item in items}
    found.discard("")
    return tuple(sorted(found))


class LedgerLabels:
    """metadata → (the session the client names, the request's tags), for the request's ledger events."""

    def __init__(self, tag_keys: Sequence[str] = DEFAULT_TAG_KEYS) -> None:
        self.tag_keys = tuple(tag_keys)

    def __call__(self, meta: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
        headers = meta.get("headers")
        return (client_session(meta, headers if isinstance(headers, Mapping) else None),
                ledger_tags(meta, self.tag_keys))
