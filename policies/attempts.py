"""The open routed attempts: one record per attempt from its pick until it ends, read by the load tracker and
the ``Router`` alike (each keeps its own part of it on the one record, none a dict of its own per request)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.policies.request import RoutingRequest


@dataclass(slots=True)
class RoutedAttempt:
    """One attempt charged to a backend: its load (``charged`` until answered, ended or expired) and, once a
    ``Router`` picked it, what the index predicted for it (held until the attempt's outcome or expiry)."""

    request_id: str
    backend: str
    started: float  # when its backend was charged: the pick, or the move to where LiteLLM sent it
    prefill_tokens: int = 0
    prefill_done: bool = False
    work_s: float = 0.0  # own prefill, prior seconds (unscaled)
    ttft_s: float = 0.0  # predicted TTFT, prior seconds (unscaled part)
    fixed_s: float = 0.0  # predicted TTFT part already in real seconds (decode-slot wait)
    first_at: float = -1.0
    charged: bool = True  # its backend's load counts it
    request: RoutingRequest | None = None  # the routed request (None: charged by the load tracker alone)
    matched_blocks: int = 0  # leading blocks the index said the backend held at pick time
    confirmed_blocks: int = 0  # of those, blocks already computed (not another request's prefill in progress)
    settled: bool = False  # its own new blocks are computed (first token) or given up
    answered_at: float | None = None  # the answer is back (``Router.on_answered``); its outcome may come later


class Attempts:
    """The open attempts by request id, oldest first (a re-charged id moves to the end); the owner bounds it."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: OrderedDict[str, RoutedAttempt] = OrderedDict()

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self) -> Iterator[RoutedAttempt]:
        return iter(list(self.open.values()))

    def get(self, request_id: str) -> RoutedAttempt | None:
        return self.open.get(request_id)

    def put(self, record: RoutedAttempt) -> None:
        """Hold ``record`` (replacing any other under its id) as the newest."""
        open_ = self.open
        known = record.request_id in open_
        open_[record.request_id] = record
        if known:
            open_.move_to_end(record.request_id)

    def pop(self, request_id: str) -> RoutedAttempt | None:
        """Stop holding an attempt; the record or None."""
        return self.open.pop(request_id, None)

    def oldest(self) -> RoutedAttempt | None:
        return next(iter(self.open.values()), None)
