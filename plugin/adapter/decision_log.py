"""The decision log: one JSON line per pick, what the router saw and chose (``KVROUTE_DECISION_LOG``).

Off by default. Each line holds the request's LiteLLM call id (a client may set it with ``x-litellm-call-id``), the
group, the ``Decision`` (backend, reason, matched tokens, scores, predicted TTFT) and the router's inputs per
candidate (``Router.trace_inputs``: believed matched tokens, of them already computed, load). Keys and numbers
only, never prompt text. Lines are appended with one ``write`` each, so several workers may share a file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvroute.policies.decision import Decision


class DecisionLog:
    """Appends decisions to ``path`` (created with its folder); a write that fails is counted, never raised."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.failed = 0

    def write(self, group: str, decision: Decision, call_id: Any) -> None:
        line = {"wall": round(time.time(), 6), "call_id": call_id if isinstance(call_id, str) else None,
                "group": group, **decision.as_dict()}
        try:
            os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        except OSError:
            self.failed += 1

    def close(self) -> None:
        os.close(self._fd)
