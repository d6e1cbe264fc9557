"""Cache tiers: where an engine holds a block, and how much of a cache hit a block held there is worth.

A block in GPU memory is a full hit. A block held only in host memory (vLLM's CPU offloading connector,
LMCache's CPU backend) is copied back to the GPU before the forward pass: cheaper than recomputing it, not
free. A block on disk or remote storage is cheaper still to keep and dearer to load. ``TierCredit`` gives each
tier the share of a GPU hit it is worth; a prefix held in several tiers is worth the sum of its blocks'
credits ("GPU-equivalent blocks"), which the cost model reads as cached tokens.

Reference default: Dynamo 1.6's KV router (``--router-kv-overlap-score-credit`` 1.0 for device blocks,
``--router-host-cache-hit-weight`` 0.75, ``--router-disk-cache-hit-weight`` 0.25). llm-d's precise prefix
scorer weighs gpu 1.0 and cpu 0.8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.policies.errors import ConfigError

GPU, HOST, DISK = 0, 1, 2
#: tier names as configuration spells them (``tier_credit: {gpu: .., cpu: .., disk: ..}``), by tier number
TIER_NAMES = ("gpu", "cpu", "disk")

# Medium strings engines publish, lower-cased: vLLM "GPU", "CPU", "STORAGE" (absent = GPU, the only medium
# before offloading); LMCache "cpu", "CXL" and disk/remote backends.
_MEDIUMS: dict[str, int] = {
    "gpu": GPU, "cuda": GPU, "device": GPU, "hbm": GPU,
    "cpu": HOST, "host": HOST, "dram": HOST, "cxl": HOST, "pinned": HOST,
    "storage": DISK, "disk": DISK, "ssd": DISK, "nvme": DISK, "gds": DISK, "local_disk": DISK, "remote": DISK,
}


def tier_of(medium: str | None) -> int:
    """The tier of an engine's ``medium`` (case-insensitive). Absent or empty → ``GPU``; a medium not known
    here → ``DISK``, the least credit: a block some slower store holds is worth something, never a GPU hit."""
    if not medium:
        return GPU
    tier = _MEDIUMS.get(medium)
    if tier is None:
        tier = _MEDIUMS.get(medium.lower(), DISK)
    return tier


@dataclass(frozen=True, slots=True)
class TierCredit:
    """Share of a GPU cache hit a block held in each tier is worth, each in [0, 1]."""

    gpu: float = 1.0
    cpu: float = 0.75
    disk: float = 0.25

    def __post_init__(self) -> None:
        for name in TIER_NAMES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ConfigError(name, f"must be a number in [0, 1], got {value!r}")

    @property
    def by_tier(self) -> tuple[float, float, float]:
        """Credits indexed by tier number (``GPU``, ``HOST``, ``DISK``)."""
        return (float(self.gpu), float(self.cpu), float(self.disk))

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, where: str = "tier_credit") -> TierCredit:
        """From a config mapping (missing tiers keep their defaults); ``ConfigError`` names the bad key."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(where, "must map tiers (gpu, cpu, disk) to credits in [0, 1]")
        unknown = sorted(set(raw) - set(TIER_NAMES))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"unknown tier (known: {', '.join(TIER_NAMES)})")
        for name, value in raw.items():
            ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
            if not ok or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{where}.{name}", f"must be a number in [0, 1], got {value!r}")
        return cls(**{k: float(v) for k, v in raw.items()})


class TieredMatch(dict):
    """A prefix index's ``match`` answer when a slower tier holds part of some backend's prefix.

    As a mapping it is what every ``match`` returns: leading blocks held per backend, in any tier.
    ``credited`` adds, for the backends where it differs, the same prefix in GPU-equivalent blocks (the sum of
    its blocks' tier credits); a backend absent from ``credited`` holds its whole prefix in GPU memory.
    """

    __slots__ = ("credited",)

    def __init__(self, held: Mapping[str, int], credited: Mapping[str, float]) -> None:
        super().__init__(held)
        self.credited: dict[str, float] = dict(credited)
