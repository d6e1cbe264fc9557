"""The decision log: one JSON line per pick, what the router saw and chose (``KVROUTE_DECISION_LOG``), and one per
attempt that ended without an answer.

Off by default. A pick's line holds the request's LiteLLM call id (a client may set it with ``x-litellm-call-id``),
the group, the ``Decision`` (backend, reason, matched tokens, scores, predicted TTFT) and the router's inputs per
candidate (``Router.trace_inputs``: believed matched tokens, of them already computed, load). An ending's line
(``"event": "ended"``, an ``ended`` listener of the attempt's events) holds how it ended (failed, cancelled,
superseded, ...), the attempt's ticket (the pick line's ``request_id``), the backend, the verdict and the class
names of the exception and its causes: why a request was retried elsewhere. Keys, numbers and class names only,
never prompt text nor error messages. Lines are appended with one ``write`` each, so several workers may share a
file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from itertools import islice
from pathlib import Path
from typing import Any

from kvroute.plugin.adapter.attempt_events import Ended, How
from kvroute.policies.decision import Decision
from kvroute.policies.outcomes import exception_links

MAX_CAUSES = 6  # exception classes followed down ``__cause__`` / ``__context__``


def exception_chain(exc: BaseException | None) -> list[str]:
    """``module.Class`` of ``exc`` and of the exceptions that caused it, outermost first (names only)."""
    links = islice(exception_links(exc), MAX_CAUSES) if exc is not None else ()
    return [f"{type(link).__module__}.{type(link).__qualname__}" for link in links]


class DecisionLog:
    """Appends decisions and endings to ``path`` (created with its folder); a write that fails is counted, never
    raised."""

    name = "decision_log"

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.failed = 0

    def write(self, group: str, decision: Decision, call_id: Any) -> None:
        line = {"wall": round(time.time(), 6), "call_id": call_id if isinstance(call_id, str) else None,
                "group": group, **decision.as_dict()}
        self._append(line)

    def ended(self, e: Ended) -> None:
        """An attempt's end, when it is not an answer (``AttemptEvents`` listener)."""
        if e.how is How.SUCCESS:
            return
        attempt = e.found[1] if e.found is not None else None
        data = e.payload.data if e.payload is not None else {}
        call_id = data.get("litellm_call_id") if isinstance(data, Mapping) else None
        verdict = e.verdict
        self._append({"wall": round(time.time(), 6), "event": "ended", "how": e.how.value,
                      "call_id": call_id if isinstance(call_id, str) else None,
                      "request_id": attempt.ticket if attempt is not None else None,
                      "group": attempt.group if attempt is not None else None, "backend": e.backend,
                      "verdict": verdict.kind.value if verdict is not None else None,
                      "blames_backend": verdict.blames_backend if verdict is not None else None,
                      "http_status": verdict.status if verdict is not None else None,
                      "error": exception_chain(e.exception)})

    def _append(self, line: dict[str, Any]) -> None:
        try:
            os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        except OSError:
            self.failed += 1

    def close(self) -> None:
        os.close(self._fd)
