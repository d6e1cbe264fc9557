"""The decision record: which backend a pick chose and why (keys and numbers only, never prompt text)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Decision:
    """Result of one pick. ``backend`` is None only when no candidate is acceptable (e.g. all open).

    ``reason`` is a short machine-readable word (``prefix_match``, ``cold``, ``session``, ...);
    ``skipped`` says why affinity was not used (``short_prompt``, ``no_session_key``, ...);
    ``fallback`` names the internal error that made the router fall back to least-load.
    """

    backend: str | None
    policy: str
    reason: str
    matched_tokens: int = 0
    prompt_tokens: int = 0
    matched_blocks: int = 0
    scores: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None
    fallback: str | None = None
    request_id: str | None = None
    predicted_prefill_tokens: int = 0
    work_s: float = 0.0  # own prefill on the chosen backend, prior seconds (the load tracker scales them)
    predicted_ttft_s: float = 0.0  # the prediction's part in prior seconds (learned factor applies)
    fixed_wait_s: float = 0.0  # the prediction's part already in real seconds (decode-slot wait)
    why: dict[str, object] | None = None  # a policy's own account (hybrid: predicted vs target, route prices)
    #: prompt tokens this pick prefills although another candidate held them at decision time (the index's
    #: view): the longest other candidate's match minus the chosen backend's, floored at 0. None until known:
    #: the ``Router`` fills it in from the index for policies that match nothing themselves.
    wasted_prefill_tokens: int | None = None
    #: what the router knew at the pick, per candidate (``Router.trace_inputs``); None unless the router traces
    inputs: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "policy": self.policy,
            "reason": self.reason,
            "matched_tokens": self.matched_tokens,
            "prompt_tokens": self.prompt_tokens,
            "matched_blocks": self.matched_blocks,
            "scores": dict(self.scores),
            "skipped": self.skipped,
            "fallback": self.fallback,
            "request_id": self.request_id,
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            **({"why": dict(self.why)} if self.why is not None else {}),
            **({"inputs": dict(self.inputs)} if self.inputs is not None else {}),
        }
