"""An independent ledger for the builder views: about 3,000 attempts over October and November 2026, four apps,
fourteen provider usage shapes, with the price file and the JSONL lines the real CLI loads; and the figures the
reports must show, worked out here from the generator's own numbers and the price file's documented formulas
(nothing of kvroute is imported)."""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

M = Decimal(10**6)
APPS = {"acme": 0.35, "beta": 0.3, "gamma": 0.2, "delta": 0.15}
CACHED_SHARE = {"acme": 0.8, "beta": 0.55, "gamma": 0.2, "delta": 0.65}
START = datetime(2026, 10, 1, tzinfo=UTC)
DAYS = 61  # October and November

# --- the price file ---------------------------------------------------------------------------------------------
PRICES: dict[str, Any] = {
    "currency": "USD",
    "backends": [
        {"id": "vllm-a", "provider": "self_hosted", "served_model": "llama-70b", "route_kind": "self_hosted",
         "rates": [{"effective_from": "2026-01-01", "gpu_hour": "2.88 USD", "prefill_tok_s": 8000,
                    "decode_tok_s": 2000},
                   {"effective_from": "2026-11-15", "gpu_hour": "3.60", "prefill_tok_s": 9000,
                    "decode_tok_s": 2400}]},
        {"id": "vllm-b", "provider": "self_hosted", "served_model": "llama-8b", "route_kind": "self_hosted",
         "rates": [{"effective_from": "2026-01-01", "gpu_hour": "1.80", "tokens_per_s": 5000,
                    "cache_read_per_mtok": "0.01"}]},
        {"id": "oai", "provider": "openai", "served_model": "gpt-x", "route_kind": "direct",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "2.5", "cache_read_per_mtok": "1.25",
                    "cache_write_5m_per_mtok": "2.5", "output_per_mtok": "10"},
                   {"effective_from": "2026-11-10", "input_per_mtok": "2", "cache_read_per_mtok": "0.5",
                    "cache_write_5m_per_mtok": "2.5", "output_per_mtok": "8"}]},
        {"id": "anth", "provider": "anthropic", "served_model": "claude-x", "route_kind": "direct",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "3", "cache_read_per_mtok": "0.3",
                    "cache_write_5m_per_mtok": "3.75", "cache_write_1h_per_mtok": "6", "output_per_mtok": "15"}]},
        {"id": "gem", "provider": "gemini", "served_model": "gemini-x", "route_kind": "direct",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "1.25", "cache_read_per_mtok": "0.3125",
                    "output_per_mtok": "10"}]},
        {"id": "ds", "provider": "deepseek", "served_model": "deepseek-x", "route_kind": "direct",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "0.27", "cache_read_per_mtok": "0.07",
                    "output_per_mtok": "1.1"}]},
        {"id": "or", "provider": "openrouter", "served_model": "claude-x", "route_kind": "marketplace",
         "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "3", "cache_read_per_mtok": "0.3",
                    "output_per_mtok": "15"}]},
        {"id": "mystery", "provider": "mystery", "served_model": "gpt-x", "route_kind": "direct"},  # no card
    ],
    "price_books": [
        {"version": 1, "effective_from": "2026-01-01", "rules": [{"name": "default", "markup_pct": "10%"}]},
        {"app": "acme", "version": 1, "effective_from": "2026-01-01", "platform_fee_pct": "5%",
         "payment_fee_pct": "3%", "rules": [{"name": "all", "markup_pct": "20%", "fee_per_request": "0.0005"}]},
        {"app": "acme", "version": 2, "effective_from": "2026-11-16", "platform_fee_pct": "6%",
         "payment_fee_pct": "3%", "rules": [{"name": "all", "markup_pct": "25%", "fee_per_request": "0.0005"}]},
        {"app": "beta", "version": 1, "effective_from": "2026-01-01", "platform_fee_pct": "5%",
         "rules": [{"name": "hosted", "match": {"route_kind": "marketplace"}, "markup_pct": "15%",
                    "surcharge_per_mtok": {"output": "1.00", "input": "0.20"}, "min_per_request": "0.0001"},
                   {"name": "rest", "markup_pct": "15%", "surcharge_per_mtok": {"output": "0.50"}}]},
        {"app": "delta", "version": 1, "effective_from": "2026-01-01", "platform_fee_pct": "10%",
         "rules": [{"name": "own", "match": {"route_kind": "self_hosted"}, "markup_pct": "30%",
                    "fee_per_request": "0.001", "bill_cancelled": False},
                   {"name": "rest", "markup_pct": "30%", "bill_cancelled": False}]},
    ],
}


def _card(rate: dict[str, Any]) -> dict[str, Decimal | None]:
    """A rate card's $/Mtok by bucket, by the documented formulas (GPU card: half-even to 1e-6 per Mtok; the older
    ``tokens_per_s`` card: not rounded, every bucket alike but cache reads)."""
    if "gpu_hour" in rate:
        hour = Decimal(str(rate["gpu_hour"]).split()[0]) * int(rate.get("gpus", 1))
        read = Decimal(rate.get("cache_read_per_mtok", "0"))
        if "tokens_per_s" in rate:
            per = hour / (Decimal(rate["tokens_per_s"]) * 3600) * M
            return {"input": per, "cache_read": read, "cache_write_5m": per, "cache_write_1h": per, "output": per,
                    "prefill_tok_s": Decimal(rate["tokens_per_s"])}

        def gpu(tok_s: object) -> Decimal:
            return (hour * M / (Decimal(str(tok_s)) * 3600)).quantize(Decimal("1e-6"), ROUND_HALF_EVEN)
        per = gpu(rate["prefill_tok_s"])
        return {"input": per, "cache_read": read, "cache_write_5m": per, "cache_write_1h": per,
                "output": gpu(rate["decode_tok_s"]), "prefill_tok_s": Decimal(rate["prefill_tok_s"])}
    return {"input": Decimal(rate.get("input_per_mtok", "0")),
            "cache_read": Decimal(rate.get("cache_read_per_mtok", "0")),
            "cache_write_5m": Decimal(rate.get("cache_write_5m_per_mtok", "0")),
            "cache_write_1h": Decimal(rate.get("cache_write_1h_per_mtok", "0")),
            "output": Decimal(rate.get("output_per_mtok", "0")), "prefill_tok_s": None}


def card_at(backend: str, at: datetime) -> dict[str, Decimal | None] | None:
    """The backend's card in force at ``at`` (the latest that started by then), None without one."""
    spec = next(b for b in PRICES["backends"] if b["id"] == backend)
    found = None
    for rate in sorted(spec.get("rates", []), key=lambda r: r["effective_from"]):
        if datetime.fromisoformat(rate["effective_from"]).replace(tzinfo=UTC) <= at:
            found = rate
    return None if found is None else _card(found)


# --- fourteen usage shapes: buckets -> what a provider (or kvroute's own bucket form) reports --------------------
@dataclass(frozen=True)
class Tokens:
    uncached: int
    read: int
    w5: int = 0
    w1: int = 0
    output: int = 0
    reasoning: int = 0


def _openai_chat(t: Tokens) -> dict:
    return {"prompt_tokens": t.uncached + t.read, "completion_tokens": t.output,
            "total_tokens": t.uncached + t.read + t.output, "prompt_tokens_details": {"cached_tokens": t.read},
            "completion_tokens_details": {"reasoning_tokens": t.reasoning}}


SHAPES: dict[str, tuple[str, tuple[str, ...], Any]] = {
    # name: (backend, buckets the shape can carry, encoder)
    "openai_chat": ("oai", ("reasoning",), _openai_chat),
    "openai_chat_cache_write": ("oai", ("w5",), lambda t: {
        "prompt_tokens": t.uncached + t.read + t.w5, "completion_tokens": t.output,
        "prompt_tokens_details": {"cached_tokens": t.read, "cache_write_tokens": t.w5}}),
    "openai_responses": ("oai", ("reasoning",), lambda t: {
        "input_tokens": t.uncached + t.read, "input_tokens_details": {"cached_tokens": t.read},
        "output_tokens": t.output, "output_tokens_details": {"reasoning_tokens": t.reasoning}}),
    "anthropic_split": ("anth", ("w5", "w1"), lambda t: {
        "input_tokens": t.uncached, "cache_read_input_tokens": t.read, "cache_creation_input_tokens": t.w5 + t.w1,
        "cache_creation": {"ephemeral_5m_input_tokens": t.w5, "ephemeral_1h_input_tokens": t.w1},
        "output_tokens": t.output}),
    "anthropic_plain": ("anth", ("w5",), lambda t: {
        "input_tokens": t.uncached, "cache_read_input_tokens": t.read, "cache_creation_input_tokens": t.w5,
        "output_tokens": t.output}),
    "litellm_anthropic": ("anth", ("w5", "w1"), lambda t: {
        "prompt_tokens": t.uncached + t.read + t.w5 + t.w1, "completion_tokens": t.output,
        "cache_read_input_tokens": t.read, "cache_creation_input_tokens": t.w5 + t.w1,
        "prompt_tokens_details": {"cached_tokens": t.read, "cache_write_tokens": t.w5 + t.w1,
                                  "cache_creation_token_details": {"ephemeral_5m_input_tokens": t.w5,
                                                                   "ephemeral_1h_input_tokens": t.w1}}}),
    "gemini_rest": ("gem", ("reasoning",), lambda t: {"usageMetadata": {
        "promptTokenCount": t.uncached + t.read, "cachedContentTokenCount": t.read,
        "candidatesTokenCount": t.output - t.reasoning, "thoughtsTokenCount": t.reasoning}}),
    "gemini_python": ("gem", (), lambda t: {"usage_metadata": {
        "prompt_token_count": t.uncached + t.read, "cached_content_token_count": t.read,
        "candidates_token_count": t.output}}),
    "deepseek": ("ds", ("reasoning",), lambda t: {
        "prompt_tokens": t.uncached + t.read, "completion_tokens": t.output, "prompt_cache_hit_tokens": t.read,
        "prompt_cache_miss_tokens": t.uncached, "completion_tokens_details": {"reasoning_tokens": t.reasoning}}),
    "openrouter": ("or", (), lambda t: {
        "prompt_tokens": t.uncached + t.read, "completion_tokens": t.output,
        "cost": str((t.uncached * 3 + t.read * Decimal("0.3") + t.output * 15) / M * Decimal("1.05")),
        "prompt_tokens_details": {"cached_tokens": t.read, "cache_write_tokens": 0}}),
    "vllm": ("vllm-a", (), lambda t: {"prompt_tokens": t.uncached + t.read, "completion_tokens": t.output,
                                      "prompt_tokens_details": {"cached_tokens": t.read}}),
    "llamacpp_timings": ("vllm-b", (), lambda t: {"timings": {"cache_n": t.read, "prompt_n": t.uncached,
                                                              "predicted_n": t.output}}),
    "llamacpp_openai": ("vllm-b", (), lambda t: {"prompt_tokens": t.uncached + t.read, "completion_tokens": t.output,
                                                 "timings": {"cache_n": t.read, "prompt_n": t.uncached}}),
    "buckets": ("vllm-a", ("w5", "reasoning"), None),  # kvroute's own form: ``usage`` buckets
}
MODELS = {b["id"]: b["served_model"] for b in PRICES["backends"]}
PROVIDERS = {b["id"]: b["provider"] for b in PRICES["backends"]}
KINDS = {b["id"]: b["route_kind"] for b in PRICES["backends"]}


@dataclass
class Attempt:
    """One generated attempt: the JSON line and what the generator knows of it."""

    line: dict[str, Any]
    app: str
    at: datetime
    backend: str
    tokens: Tokens
    final: bool
    status: str
    ttft_ms: int | None = None


@dataclass
class IndependentLedger:
    attempts: list[Attempt] = field(default_factory=list)
    late: list[Attempt] = field(default_factory=list)

    def write(self, folder: Path) -> tuple[Path, Path, Path]:
        """(prices.yaml, events.jsonl, late.jsonl) in ``folder``."""
        import yaml
        prices = folder / "prices.yaml"
        prices.write_text(yaml.safe_dump(PRICES, sort_keys=False))
        events, late = folder / "events.jsonl", folder / "late.jsonl"
        events.write_text("".join(json.dumps(a.line) + "\n" for a in self.attempts))
        late.write_text("".join(json.dumps(a.line) + "\n" for a in self.late))
        return prices, events, late

    # --- expected figures, from the generator's own numbers ----------------------------------------------------
    def cache_savings(self, attempts: list[Attempt]) -> dict[str, Decimal]:
        """Per app: Σ cache reads × (uncached − cache-read price) / 1e6 of the card in force at each attempt."""
        out: dict[str, Decimal] = defaultdict(Decimal)
        for a in attempts:
            card = card_at(a.backend, a.at)
            if card is not None and a.tokens.read:
                out[a.app] += a.tokens.read * (card["input"] - card["cache_read"]) / M
        return dict(out)

    @staticmethod
    def spend(a: Attempt) -> Decimal:
        """What the attempt cost (billed or absorbed): the provider's reported cost, else its card's price of its
        tokens (to 1e-10, as the ledger stores amounts), else 0 (a backend without a card)."""
        raw = a.line.get("raw_usage")
        reported = raw.get("cost") if isinstance(raw, dict) else None
        if reported is not None:
            return Decimal(reported).quantize(Decimal("1e-10"))
        card = card_at(a.backend, a.at)
        if card is None:
            return Decimal(0)
        t = a.tokens
        total = (t.uncached * card["input"] + t.read * card["cache_read"] + t.w5 * card["cache_write_5m"]
                 + t.w1 * card["cache_write_1h"] + t.output * card["output"]) / M
        return total.quantize(Decimal("1e-10"), ROUND_HALF_EVEN)

    @staticmethod
    def absorbs_cancelled(app: str) -> bool:
        """Whether ``app``'s price book absorbs a request its client left (``bill_cancelled: false``)."""
        return app == "delta"

    def unpriced_reads(self, attempts: list[Attempt]) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for a in attempts:
            if card_at(a.backend, a.at) is None:
                out[a.app] += a.tokens.read + a.tokens.w5 + a.tokens.w1
        return dict(out)

    @staticmethod
    def in_month(attempts: list[Attempt], month: str) -> list[Attempt]:
        return [a for a in attempts if a.at.strftime("%Y-%m") == month]

    @staticmethod
    def final_per_day(attempts: list[Attempt], first: date, last: date) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = defaultdict(int)
        for a in attempts:
            if a.final and first <= a.at.date() <= last:
                out[(a.app, a.at.date().isoformat())] += 1
        return dict(out)


def _tokens(rng: random.Random, app: str, carries: tuple[str, ...]) -> Tokens:
    prompt = rng.randrange(300, 24000)
    share = min(0.98, max(0.0, rng.gauss(CACHED_SHARE[app], 0.12)))
    read = int(prompt * share)
    w5 = rng.randrange(0, 800) if "w5" in carries and rng.random() < 0.4 else 0
    w1 = rng.randrange(0, 400) if "w1" in carries and rng.random() < 0.3 else 0
    output = rng.randrange(1, 1500)
    reasoning = rng.randrange(0, output + 1) if "reasoning" in carries and rng.random() < 0.3 else 0
    return Tokens(prompt - read - w5 - w1 if prompt - read - w5 - w1 > 0 else 1, read, w5, w1, output, reasoning)


def _stamp(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _line(request: str, attempt: int, app: str, at: datetime, backend: str, *, final: bool = True,
          status: str = "success", shape: str | None = None, tokens: Tokens | None = None, **extra: Any) -> dict:
    line: dict[str, Any] = {"request_id": request, "attempt": attempt, "final": final, "app_id": app,
                            "occurred_at": _stamp(at), "served_model": MODELS[backend],
                            "provider": PROVIDERS[backend], "backend_id": backend, "route_kind": KINDS[backend],
                            "status": status}
    t = tokens or Tokens(0, 0)
    if shape is None or SHAPES[shape][2] is None:
        line["usage"] = {"input_uncached": t.uncached, "cache_read": t.read, "cache_write_5m": t.w5,
                         "cache_write_1h": t.w1, "output": t.output, "reasoning": t.reasoning}
    else:
        line["raw_usage"] = SHAPES[shape][2](t)
    line.update({k: v for k, v in extra.items() if v is not None})
    return line


def _ttft(rng: random.Random, t: Tokens, self_hosted: bool) -> int:
    prefill = t.uncached / (9000 if self_hosted else 4000)
    return max(5, int(1000 * (0.04 + prefill) * math.exp(rng.gauss(0, 0.35))))


def generate(seed: int = 20261205, requests: int = 2650, late: int = 40) -> IndependentLedger:
    """``requests`` client requests (about 1.13 attempts each) over October and November, then ``late`` October
    requests that arrive after October is closed."""
    rng = random.Random(seed)
    out = IndependentLedger()
    for i in range(requests + late):
        is_late = i >= requests
        app = rng.choices(list(APPS), weights=list(APPS.values()))[0]
        at = START + timedelta(seconds=rng.randrange((31 if is_late else DAYS) * 86400))
        made = _request(rng, f"{'late' if is_late else 'req'}-{i}", app, at)
        (out.late if is_late else out.attempts).extend(made)
    return out


def _request(rng: random.Random, rid: str, app: str, at: datetime) -> list[Attempt]:
    """The attempts of one request: maybe a failed, cut or hedged attempt first, then its final one."""
    shape = rng.choice(list(SHAPES))
    backend, carries, _ = SHAPES[shape]
    if shape == "openai_chat" and rng.random() < 0.25:
        backend = "mystery"  # no rate card: its savings are unpriced, never 0
    extra: dict[str, Any] = {}
    if rng.random() < 0.5:
        extra["session_id"] = f"{app}-s{rng.randrange(120)}"
    roll = rng.random()
    if roll < 0.3:
        extra["tags"] = ["team:x"] if roll < 0.2 else ["team:y", "batch"]
    if rng.random() < 0.8:
        extra["end_user"] = f"{app}-cust-{rng.randrange(5)}"
    made: list[Attempt] = []

    def add(attempt: int, when: datetime, *, final: bool, status: str, tokens: Tokens, line_shape: str | None,
            **more: Any) -> None:
        line = _line(rid, attempt, app, when, backend, final=final, status=status, shape=line_shape, tokens=tokens,
                     **extra, **more)
        made.append(Attempt(line, app, when, backend, tokens, final, status, more.get("ttft_ms")))

    kind = rng.random()
    first = 0
    if kind < 0.07:  # a failed attempt, then the answer
        add(0, at, final=False, status=rng.choice(["provider_failure", "capacity"]), tokens=Tokens(0, 0),
            line_shape=None, http_status=rng.choice([500, 429]))
        first = 1
    elif kind < 0.11:  # a stream the provider cut after output went out: paid, absorbed
        p = _tokens(rng, app, ())
        cut = Tokens(p.uncached + p.read, 0, 0, 0, rng.randrange(1, 40))
        line = _line(rid, 0, app, at, backend, final=False, status="provider_failure", tokens=cut, **extra)
        line.pop("usage")
        line["raw_usage"] = {"prompt_tokens": cut.uncached, "completion_tokens": cut.output,
                             "kvroute_estimate": "stream_cut"}
        made.append(Attempt(line, app, at, backend, cut, False, "provider_failure"))
        first = 1
    elif kind < 0.12:  # a hedge's losing attempt
        add(0, at, final=False, status="cancelled", tokens=_tokens(rng, app, carries), line_shape=None,
            error_type="hedge_lost")
        first = 1
    when = at + timedelta(seconds=first * 2)
    tokens = _tokens(rng, app, carries)
    final_kind = rng.random()
    if final_kind < 0.03:  # the client went away
        add(first, when, final=True, status="cancelled", tokens=Tokens(tokens.uncached, tokens.read), line_shape=None)
    elif final_kind < 0.06:  # the request failed
        add(first, when, final=True, status="provider_failure", tokens=Tokens(0, 0), line_shape=None,
            http_status=502, fallback_depth=first or None)
    elif final_kind < 0.08:  # an empty answer
        add(first, when, final=True, status="zero_completion", tokens=Tokens(tokens.uncached, tokens.read),
            line_shape=None)
    else:
        timed = rng.random()
        ttft = _ttft(rng, tokens, KINDS[backend] == "self_hosted") if timed < 0.92 else None
        duration = (ttft or 50) + tokens.output * rng.randrange(8, 25) if timed < 0.97 else None
        add(first, when, final=True, status="success", tokens=tokens, line_shape=shape, ttft_ms=ttft,
            duration_ms=duration, fallback_depth=first or None, streamed=rng.random() < 0.6)
    return made
