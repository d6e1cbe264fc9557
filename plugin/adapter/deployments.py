"""Classify LiteLLM ``model_list`` deployments: self-hosted replicas vs hosted providers.

A deployment is a self-hosted replica when ``model_info.engine`` names an engine (``vllm``, ``sglang``,
``llamacpp``) or its provider prefix is ``hosted_vllm``; otherwise it is a hosted provider (OpenAI,
Anthropic, OpenRouter, a marketplace, or any OpenAI-compatible URL) with per-token prices from
``model_info``/``litellm_params`` or LiteLLM's cost map. The backend id is ``model_info.id``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlparse

from kvroute.policies.errors import ConfigError

ENGINES = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "llama.cpp": "llamacpp",
           "llama_cpp": "llamacpp"}
ENGINE_PROVIDERS = {"hosted_vllm": "vllm", "llamafile": "llamacpp"}
MARKETPLACE_HOSTS = ("shareai",)
PRICE_KEYS = ("input_cost_per_token", "output_cost_per_token", "cache_read_input_token_cost")

CostMap = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Backend:
    """One deployment as kvroute sees it; prices are ``Decimal`` per token in ``currency``."""

    id: str
    group: str
    model: str
    kind: str  # "self_hosted" | "hosted"
    provider: str
    api_base: str | None = None
    engine: str | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    slots: int | None = None  # sequences the engine runs at once (llama.cpp ``--parallel``)
    metrics_url: str | None = None
    input_price: Decimal | None = None
    output_price: Decimal | None = None
    cache_read_price: Decimal | None = None
    currency: str = "USD"

    @property
    def self_hosted(self) -> bool:
        return self.kind == "self_hosted"

    @property
    def caching_pays(self) -> bool:
        """Cache reads are cheaper than fresh input (only then is provider stickiness worth it)."""
        if self.input_price is None or self.cache_read_price is None:
            return False
        return self.cache_read_price < self.input_price

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = str(value) if isinstance(value, Decimal) else value
        return out


def _decimal(value: Any, key: str) -> Decimal | None:
    if value is None or value == "":
        return None
    try:
        result = Decimal(str(value))
    except InvalidOperation as exc:
        raise ConfigError(key, f"not a number: {value!r}") from exc
    if result < 0 or not result.is_finite():
        raise ConfigError(key, f"must be a finite number >= 0, got {value!r}")
    return result


def _positive_int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    try:
        result = int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(key, f"not an integer: {value!r}") from exc
    if result <= 0:
        raise ConfigError(key, f"must be > 0, got {value!r}")
    return result


def _provider(model: str, api_base: str | None, info: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    explicit = info.get("provider") or params.get("custom_llm_provider")
    if explicit:
        return str(explicit).lower()
    host = (urlparse(api_base).hostname or "").lower() if api_base else ""
    if any(m in host for m in MARKETPLACE_HOSTS):
        return "marketplace"
    if "openrouter.ai" in host:
        return "openrouter"
    prefix = model.split("/", 1)[0].lower() if "/" in model else "openai"
    if prefix == "openai" and api_base and "api.openai.com" not in host:
        return "openai_compatible"
    return prefix


def _cost_entry(cost_map: CostMap | None, model: str) -> Mapping[str, Any]:
    if not cost_map:
        return {}
    entry = cost_map.get(model)
    if entry is None and "/" in model:
        entry = cost_map.get(model.split("/", 1)[1])
    return entry if isinstance(entry, Mapping) else {}


def classify(deployment: Mapping[str, Any], cost_map: CostMap | None = None, *, kind: str = "auto",
             where: str = "model_list") -> Backend:
    """One ``model_list`` entry → ``Backend``; bad numbers raise ``ConfigError`` naming the field."""
    params = deployment.get("litellm_params") or {}
    info = deployment.get("model_info") or {}
    if not isinstance(params, Mapping) or not isinstance(info, Mapping):
        raise ConfigError(where, "litellm_params and model_info must be mappings")
    group = str(deployment.get("model_name") or "")
    model = str(params.get("model") or "")
    backend_id = str(info.get("id") or "")
    if not backend_id:
        raise ConfigError(f"{where}.model_info.id", "every deployment kvroute routes needs an id")
    api_base = params.get("api_base") or info.get("api_base")
    api_base = str(api_base) if api_base else None
    engine_name = info.get("engine")
    engine = None
    if engine_name is not None:
        engine = ENGINES.get(str(engine_name).lower())
        if engine is None:
            raise ConfigError(f"{where}.model_info.engine",
                              f"unknown engine {engine_name!r}; known: vllm, sglang, llamacpp")
    prefix = model.split("/", 1)[0].lower() if "/" in model else ""
    engine = engine or ENGINE_PROVIDERS.get(prefix)
    resolved_kind = kind if kind != "auto" else ("self_hosted" if engine else "hosted")
    provider = _provider(model, api_base, info, params)
    if resolved_kind == "self_hosted" and engine:
        provider = engine
    cost = _cost_entry(cost_map, model)
    prices: dict[str, Decimal | None] = {}
    for key in PRICE_KEYS:
        value = info.get(key, params.get(key, cost.get(key)))
        prices[key] = _decimal(value, f"{where}.model_info.{key}")
    input_price = prices["input_cost_per_token"]
    cache_read = prices["cache_read_input_token_cost"]
    return Backend(
        id=backend_id,
        group=group,
        model=model,
        kind=resolved_kind,
        provider=provider,
        api_base=api_base,
        engine=engine,
        kv_capacity_tokens=_positive_int(info.get("kv_capacity_tokens"), f"{where}.model_info.kv_capacity_tokens"),
        block_size=_positive_int(info.get("block_size"), f"{where}.model_info.block_size"),
        slots=_positive_int(info.get("slots"), f"{where}.model_info.slots"),
        metrics_url=str(info["metrics_url"]) if info.get("metrics_url") else None,
        input_price=input_price,
        output_price=prices["output_cost_per_token"],
        cache_read_price=cache_read if cache_read is not None else input_price,
        currency=str(info.get("currency") or "USD"),
    )


def litellm_cost_map() -> CostMap:
    """LiteLLM's model cost map (empty when LiteLLM is not installed)."""
    try:
        import litellm
    except ImportError:  # pragma: no cover - the plugin always runs inside LiteLLM
        return {}
    return getattr(litellm, "model_cost", {}) or {}


class Deployments:
    """Backends by id, learned from ``model_list`` up front or from the deployments hooks hand over."""

    def __init__(self, cost_map: CostMap | Callable[[], CostMap] | None = None,
                 group_kind: Callable[[str], str] | None = None) -> None:
        self._cost_map = cost_map
        self._group_kind = group_kind or (lambda _group: "auto")
        self.backends: dict[str, Backend] = {}

    def _costs(self) -> CostMap | None:
        if callable(self._cost_map):
            self._cost_map = self._cost_map()
        return self._cost_map

    def add_model_list(self, model_list: Iterable[Mapping[str, Any]]) -> list[Backend]:
        """Classify every entry; a bad entry raises ``ConfigError`` naming ``model_list.<i>.<field>``."""
        added = []
        for i, dep in enumerate(model_list):
            backend = classify(dep, self._costs(), kind=self._group_kind(str(dep.get("model_name") or "")),
                               where=f"model_list.{i}")
            self.backends[backend.id] = backend
            added.append(backend)
        return added

    def backend(self, deployment: Mapping[str, Any]) -> Backend:
        """The ``Backend`` of one deployment dict (classified once, then cached by id)."""
        info = deployment.get("model_info") or {}
        backend_id = str(info.get("id") or "")
        found = self.backends.get(backend_id)
        if found is not None:
            return found
        backend = classify(deployment, self._costs(), kind=self._group_kind(str(deployment.get("model_name") or "")))
        self.backends[backend.id] = backend
        return backend

    def groups(self) -> dict[str, list[Backend]]:
        out: dict[str, list[Backend]] = {}
        for b in self.backends.values():
            out.setdefault(b.group, []).append(b)
        return out
