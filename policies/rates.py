"""Rate cards both sides of a fleet share: a hosted route's (``ProviderQuote``), a self-hosted replica's
(``SelfHostedRate``), and ``to_price``, the one way a configured price becomes a ``Decimal``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvroute.policies.errors import ConfigError


def to_price(value: Any, where: str) -> Decimal:
    """A non-negative finite ``Decimal`` from a Decimal, int, str or float (floats via their repr)."""
    if isinstance(value, bool):
        raise ConfigError(where, "must be a price, not a boolean")
    try:
        price = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError, TypeError) as exc:
        raise ConfigError(where, f"not a number: {value!r}") from exc
    if not price.is_finite() or price < 0:
        raise ConfigError(where, f"must be a finite price >= 0, got {value!r}")
    return price


@dataclass(frozen=True, slots=True)
class ProviderQuote:
    """One hosted backend's rate card; prices are per token in ``currency``.

    ``cache_read_price``/``cache_write_price`` default to the input price (no caching discount).
    ``kind`` is the wire dialect (``openai``, ``openrouter``, ``anthropic``, ``shareai``, ...).
    """

    backend: str
    provider: str
    model: str
    input_price: Decimal
    output_price: Decimal
    cache_read_price: Decimal | None = None
    cache_write_price: Decimal | None = None
    uptime_tier: str = "standard"
    max_context: int | None = None
    kind: str = "openai"
    currency: str = "USD"

    def __post_init__(self) -> None:
        where = f"quotes.{self.backend}"
        if not self.backend or not self.provider:
            raise ConfigError(where, "backend and provider must be non-empty")
        for name in ("input_price", "output_price", "cache_read_price", "cache_write_price"):
            value = getattr(self, name)
            if value is None and name.startswith("cache_"):
                value = self.input_price
            object.__setattr__(self, name, to_price(value, f"{where}.{name}"))
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 1):
            raise ConfigError(f"{where}.max_context", "must be a positive integer or None")

    @classmethod
    def parse(cls, backend: str, raw: Any, where: str) -> ProviderQuote:
        """From a config mapping (prices per token as decimal strings); errors name the key."""
        if not isinstance(raw, Mapping):
            raise ConfigError(where, "must be a mapping (provider, model, input_price, output_price, ...)")
        known = {"provider", "model", "input_price", "output_price", "cache_read_price", "cache_write_price",
                 "uptime_tier", "max_context", "kind", "currency"}
        for key in raw:
            if key not in known:
                raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        for key in ("input_price", "output_price"):
            if key not in raw:
                raise ConfigError(f"{where}.{key}", "required")
        fields = dict(raw)
        fields.setdefault("provider", backend)
        fields.setdefault("model", "")
        return cls(backend=backend, **fields)

    @property
    def caching_pays(self) -> bool:
        """Cache reads are cheaper than uncached input (OpenRouter's condition for stickiness)."""
        assert self.cache_read_price is not None
        return self.cache_read_price < self.input_price

    def effective_input_price(self, expected_hit: float) -> Decimal:
        """input × (1 − hit) + cache_read × hit, per prompt token."""
        hit = Decimal(str(round(min(1.0, max(0.0, expected_hit)), 6)))
        assert self.cache_read_price is not None
        return self.input_price * (1 - hit) + self.cache_read_price * hit


@dataclass(frozen=True, slots=True)
class SelfHostedRate:
    """What one self-hosted token costs (from the rate card or the price book), per token in ``currency``."""

    input_price: Decimal
    output_price: Decimal
    currency: str = "USD"

    def price(self, prompt_tokens: int, output_tokens: float) -> Decimal:
        return self.input_price * max(0, prompt_tokens) + self.output_price * Decimal(str(round(output_tokens, 3)))
