"""``ReturnGap``: how long conversations take to come back, learned from the turns that did.

A held context (a cached prompt, a live session's context) is worth what its conversation is likely to come back
for. While its request runs it is worth all of it (for at most the cap: past that, its end was lost). Once
answered, it loses half its worth every typical gap between an answer and the conversation's next turn on this
fleet: the decayed mean gap, kept within ``MIN_HALF_LIFE_S`` and the cap. Before any turn came back that half-life
is the cap; the mean is trusted by the share of ``SAMPLES`` turns that did (geometrically between the cap and it),
wholly from ``SAMPLES`` on, so a fresh router that has seen seven agents' turns come back within 30 ms no longer
values a finished agent's context like a live one's for the next minute. A fleet whose sessions answer in a second
then no longer values a minute-old context of a finished conversation like the live one beside it.
"""

from __future__ import annotations

SAMPLES = 8  # turns that came back before the learned gap replaces the cap
ALPHA = 0.1  # weight of each new gap in the mean
MIN_HALF_LIFE_S = 0.05


class ReturnGap:
    """The decayed mean gap from an answer to its conversation's next turn, and the worth it gives a held context."""

    __slots__ = ("cap_s", "mean_s", "samples")

    def __init__(self, cap_s: float) -> None:
        if not cap_s > 0:
            raise ValueError("cap_s must be > 0")
        self.cap_s = cap_s
        self.mean_s: float | None = None
        self.samples = 0

    def note(self, gap_s: float) -> None:
        """A turn came back ``gap_s`` seconds after its conversation's answer (a negative gap is ignored)."""
        if gap_s < 0:
            return
        self.samples += 1
        mean = self.mean_s
        self.mean_s = gap_s if mean is None else mean + ALPHA * (gap_s - mean)

    @property
    def half_life_s(self) -> float:
        """How fast an answered context's worth halves: ``cap ** (1 - t) * gap ** t``, ``t`` the share of ``SAMPLES``
        turns that came back (at most 1), ``gap`` the learned mean within the floor and the cap."""
        if self.mean_s is None:
            return self.cap_s
        gap = min(self.cap_s, max(MIN_HALF_LIFE_S, self.mean_s))
        if self.samples >= SAMPLES:
            return gap
        trust = self.samples / SAMPLES
        return self.cap_s ** (1.0 - trust) * gap ** trust

    def worth(self, age_s: float, running: bool, half_s: float) -> float:
        """A context ``age_s`` seconds after it was last sent or answered: whole while its request runs (at most
        the cap), else halved every ``half_s`` (``half_life_s``, read once by a caller weighing many)."""
        age = age_s if age_s > 0.0 else 0.0
        return 1.0 if running and age < self.cap_s else 0.5 ** (age / half_s)
