"""Test doubles at the billing feed's boundary: a recorder that keeps the events it is handed, an upstream error."""

from __future__ import annotations


class Recorder:
    """Collects events (the feed's boundary: what it hands to ``UsageRecorder.record``)."""

    def __init__(self) -> None:
        self.events: list = []

    def record(self, event) -> None:
        self.events.append(event)


class UpstreamError(Exception):
    """An exception carrying an HTTP status, as LiteLLM's provider errors do."""

    def __init__(self, msg: str, status_code: int) -> None:
        super().__init__(msg)
        self.status_code = status_code
