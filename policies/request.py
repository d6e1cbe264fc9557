"""The routing request: what the policies know about one LLM call (keys and sizes, never text)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class RoutingRequest:
    """One request as the router sees it.

    ``keys`` are chained block keys in prefix order: ``keys[k]`` identifies blocks ``0..k`` together,
    so a backend holding ``keys[k]`` (probably) holds every earlier block too. ``block_tokens`` is the
    size of one block in tokens (estimated for byte blocks, exact for token-id blocks).
    """

    model: str
    keys: Sequence[int]
    block_tokens: float
    prompt_tokens: int
    session_key: str | None = None
    tenant: str | None = None
    app: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    request_id: str | None = None
    kind: str = "chat"
    notes: tuple[str, ...] = ()
    key_space: str = "bytes"

    @property
    def routable_tokens(self) -> int:
        return int(len(self.keys) * self.block_tokens)

    def prefix_key(self, tokens: int) -> int | None:
        """Chained key covering about the first ``tokens`` tokens (the stable start), or None if shorter."""
        if not self.keys:
            return None
        blocks = max(1, int(tokens // self.block_tokens)) if self.block_tokens > 0 else 1
        return self.keys[min(blocks, len(self.keys)) - 1]
