"""kvroute settings: declared once, from env (``KVROUTE_*``) over a YAML ``kvroute:`` block.

The YAML block lives in the file named by ``KVROUTE_CONFIG`` or in the LiteLLM proxy's own config.yaml.
Every validation error is raised as ``ConfigError`` whose key names the bad setting (``kvroute.groups.x.policy``).
This is the only module of kvroute that reads environment variables.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvroute.policies.errors import ConfigError
from kvroute.policies.registry import DEFAULT_POLICY, build_config


def _load_optional_policies() -> None:
    """Register policies that live in optional modules (marketplace) so config can name them."""
    with contextlib.suppress(ImportError):
        import kvroute.policies.marketplace  # noqa: F401


def _check_policy(name: str, knobs: Mapping[str, Any], where: str) -> None:
    _load_optional_policies()
    build_config(name, knobs, where)


class GroupSettings(BaseModel):
    """Per model group: policy and knobs, approximate or precise index, hosted or self-hosted."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = None
    knobs: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["approx", "precise"] = "approx"
    kind: Literal["auto", "self_hosted", "hosted"] = "auto"
    precise: dict[str, Any] = Field(default_factory=dict)


class RuleMatch(BaseModel):
    """What a rule matches: model group, app, and request tag/metadata values (all given must hold)."""

    model_config = ConfigDict(extra="forbid")

    group: str | None = None
    app: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class RuleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    match: RuleMatch = Field(default_factory=RuleMatch)
    policy: str
    knobs: dict[str, Any] = Field(default_factory=dict)


class KvrouteSettings(BaseSettings):
    """Everything the plugin is configured with; env ``KVROUTE_<FIELD>`` overrides the YAML block."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid", env_nested_delimiter="__")

    config: Path | None = None
    enabled: bool = True
    default_policy: str = DEFAULT_POLICY
    default_knobs: dict[str, Any] = Field(default_factory=dict)
    hosted_policy: str = "marketplace"
    groups: dict[str, GroupSettings] = Field(default_factory=dict)
    rules: list[RuleSettings] = Field(default_factory=list)
    app_metadata_keys: list[str] = Field(default_factory=lambda: ["app", "app_id", "application"])
    tag_metadata_keys: list[str] = Field(default_factory=lambda: ["workload", "tags"])
    forward_cache_key: bool = True
    breaker: dict[str, Any] = Field(default_factory=dict)
    redis_url: str | None = None
    redis_namespace: str = Field(default="kvroute", min_length=1, pattern=r"^\S+$")
    billing: bool = False
    billing_db: str | None = None
    billing_spool: Path | None = None  # the journal folder (default <data_dir>/journal)
    data_dir: Path = Path(".kvroute")  # KVROUTE_DATA_DIR: embedded ledger, journal, dead letters
    billing_fsync_interval_s: float = Field(default=1.0, gt=0, le=60)  # the machine-crash window of the journal
    max_apps_per_key: int = Field(default=20, ge=1, le=10_000)  # app labels one key can claim in metrics
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_app_labels: int = Field(default=50, ge=1, le=10_000)
    status_path: str = "/kvroute/status"
    block_bytes: int = Field(default=256, ge=16)
    kv_capacity_tokens: int = Field(default=500_000, ge=1)
    index_ttl_s: float | None = Field(default=None, gt=0)
    expire_every_s: float = Field(default=30.0, gt=0)
    max_request_age_s: float = Field(default=600.0, gt=0)
    metrics_scrape_interval_s: float = Field(default=1.0, gt=0)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)

    @field_validator("metrics_port")
    @classmethod
    def _port(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v <= 65535):
            raise ValueError("must be a TCP port (0-65535)")
        return v

    @field_validator("status_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must start with '/'")
        return v

    def check_policies(self) -> KvrouteSettings:
        """Every named policy exists and its knobs are valid; raises ``ConfigError`` naming the key."""
        _check_policy(self.default_policy, self.default_knobs, "kvroute.default_policy")
        for group, gs in self.groups.items():
            if gs.policy is not None:
                _check_policy(gs.policy, gs.knobs, f"kvroute.groups.{group}.policy")
        for i, rule in enumerate(self.rules):
            _check_policy(rule.policy, rule.knobs, f"kvroute.rules.{i}.policy")
        return self

    @property
    def billing_enabled(self) -> bool:
        """Asked for explicitly (the proxy also records by default: ``kvroute.plugin.billing_feed``)."""
        return (self.billing or bool(self.billing_db)) and (self.billing_db or "").lower() != "off"

    def group(self, name: str) -> GroupSettings:
        return self.groups.get(name) or GroupSettings()


def _key_of(loc: tuple[Any, ...]) -> str:
    return ".".join(["kvroute", *(str(p) for p in loc)]) if loc else "kvroute"


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError("KVROUTE_CONFIG", f"cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), "top level must be a mapping")
    return resolve_env_refs(data)


ENV_REF = "os.environ/"


def resolve_env_refs(value: Any) -> Any:
    """Replace ``os.environ/NAME`` strings by the variable's value (None when unset), as LiteLLM's proxy does."""
    if isinstance(value, str) and value.startswith(ENV_REF):
        return os.environ.get(value[len(ENV_REF):])
    if isinstance(value, Mapping):
        return {k: resolve_env_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env_refs(v) for v in value]
    return value


def read_model_list(path: str | Path) -> list[Any]:
    """The ``model_list`` of a LiteLLM proxy config ([] when absent)."""
    entries = _read_yaml(Path(path)).get("model_list") or []
    return list(entries) if isinstance(entries, list) else []


def read_block(path: Path) -> dict[str, Any]:
    """The ``kvroute:`` block of a YAML file ({} when it has none); bad YAML raises ``ConfigError``."""
    data = _read_yaml(path)
    block = data.get("kvroute") or {}
    if not isinstance(block, Mapping):
        raise ConfigError("kvroute", "must be a mapping")
    return dict(block)


def load_settings(proxy_config: str | Path | None = None, **overrides: Any) -> KvrouteSettings:
    """Settings from env, the YAML named by ``KVROUTE_CONFIG`` (else ``proxy_config``), then ``overrides``."""
    try:
        first = KvrouteSettings(**overrides)
        block: dict[str, Any] = {}
        source = first.config or (Path(proxy_config) if proxy_config else None)
        if source is not None:
            block = read_block(Path(source))
            block.pop("config", None)
        settings = KvrouteSettings(**{**block, **overrides}) if block else first
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err.get("loc", ()) if p != "__root__")
        raise ConfigError(_key_of(loc), err.get("msg", "invalid")) from exc
    return settings.check_policies()
