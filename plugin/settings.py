"""kvroute settings: declared once, from env (``KVROUTE_*``) over a YAML ``kvroute:`` block.

The YAML block lives in the file ``kvroute.billing.settings.config_file`` finds (the one the commands read too):
``KVROUTE_CONFIG``'s, else the LiteLLM proxy's own config.yaml.
Every validation error is raised as ``ConfigError`` whose key names the bad setting (``kvroute.groups.x.policy``).
With ``kvroute.billing.settings`` (the billing commands and the drainer) the only module of kvroute that reads
environment variables: ``KvrouteSettings`` for the proxy, ``CliSettings`` for the CLI's own switches,
``kvroute_environment`` for ``kvroute check``'s list of overrides, ``resolve_env_refs`` for ``os.environ/NAME``
values. Everything else receives plain values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvroute.billing.settings import LedgerSettings, config_file
from kvroute.plugin.state.redis_url import FROM_LITELLM, from_litellm
from kvroute.plugin.state.redis_url import check as check_redis_url
from kvroute.policies.errors import ConfigError
from kvroute.policies.registry import DEFAULT_POLICY, build_config, did_you_mean


def _load_optional_policies() -> None:
    """Register policies that live in optional modules (marketplace) so config can name them."""
    with contextlib.suppress(ImportError):
        import kvroute.policies.marketplace  # noqa: F401


def _check_policy(name: str, knobs: Mapping[str, Any], where: str, knobs_where: str | None = None) -> None:
    _load_optional_policies()
    build_config(name, knobs, where, knobs_where)


Isolation = Literal["none", "team", "key", "app"]


class GroupSettings(BaseModel):
    """Per model group: policy and knobs, approximate or precise index, hosted or self-hosted, and whose
    prefixes may be shared (``isolation``: none, or one key space per team / API key / app of the key; unset,
    the settings' ``default_isolation``)."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = None
    knobs: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["approx", "precise"] = "approx"
    kind: Literal["auto", "self_hosted", "hosted"] = "auto"
    precise: dict[str, Any] = Field(default_factory=dict)
    isolation: Isolation = "none"
    hybrid: dict[str, Any] | None = None  # the ``hybrid`` policy's knobs: self-hosted first, overflow to hosted
    hedge: dict[str, Any] | None = None  # hedged streams on hosted routes (``kvroute.policies.hedging.HedgeConfig``)

    @property
    def policy_knobs(self) -> tuple[str | None, dict[str, Any]]:
        """The group's policy and knobs (a ``hybrid:`` block is the ``hybrid`` policy with those knobs)."""
        if self.hybrid is not None:
            return "hybrid", self.hybrid
        return self.policy, self.knobs


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


class AppSettings(BaseModel):
    """One app's API keys for ``kvroute.plugin.adapter.app_keys.auth``: ``os.environ/NAME`` or ``sha256:<hex>`` entries,
    kept only as ``sha256:<hex>`` once validated."""

    model_config = ConfigDict(extra="forbid")

    keys: list[str | None] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _hashed(cls, v: list[str | None]) -> list[str]:
        from kvroute.plugin.adapter.key_hashes import hash_entries

        return hash_entries(v)


class KvrouteSettings(LedgerSettings):
    """Everything the plugin is configured with; env ``KVROUTE_<FIELD>`` overrides the YAML block. Where the ledger
    lives (``data_dir``, ``billing_db``, ``billing_spool``) is billing's ``LedgerSettings``, extended here."""

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
    apps: dict[str, AppSettings] = Field(default_factory=dict)  # key -> app without LiteLLM's database
    # every group's isolation unless it sets its own; unset: per app when ``apps`` names more than one, else none
    isolation: Isolation | None = None
    _app_keys: dict[str, str] = PrivateAttr(default_factory=dict)
    _default_group: GroupSettings | None = PrivateAttr(default=None)
    billing: bool = False
    billing_fsync_interval_s: float = Field(default=1.0, gt=0, le=60)  # the machine-crash window of the journal
    max_apps_per_key: int = Field(default=20, ge=1, le=10_000)  # app labels one key can claim in metrics
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_app_labels: int = Field(default=50, ge=1, le=10_000)
    status_path: str = "/kvroute/status"
    decision_log: Path | None = None  # a JSONL file: one line per pick, what the router saw (off by default)
    block_bytes: int = Field(default=256, ge=16)
    kv_capacity_tokens: int = Field(default=500_000, ge=1)
    index_ttl_s: float | None = Field(default=None, gt=0)
    expire_every_s: float = Field(default=30.0, gt=0)
    max_request_age_s: float = Field(default=600.0, gt=0)
    metrics_scrape_interval_s: float = Field(default=1.0, gt=0)
    hash_secret: SecretStr | None = Field(default=None, min_length=16)
    hash_secret_file: Path | None = None  # a file holding the secret (>= 16 bytes): e.g. a mounted secret
    endpoint_auth: Literal["admin", "key", "open"] = "admin"
    prometheus_multiproc_dir: Path | None = Field(
        default=None, validation_alias=AliasChoices("prometheus_multiproc_dir", "PROMETHEUS_MULTIPROC_DIR"))

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

    @field_validator("prometheus_multiproc_dir")
    @classmethod
    def _multiproc_dir(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_dir():
            raise ValueError(f"{v} is not a directory (create it, empty, before the proxy starts)")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is None or v == FROM_LITELLM:
            return v
        try:
            return check_redis_url(v)
        except ConfigError as exc:
            raise ValueError(exc.message) from None

    @field_validator("billing_db")
    @classmethod
    def _billing_db(cls, v: str | None) -> str | None:
        if v is not None:
            _check_database_url(v)
        return v

    def check_policies(self) -> KvrouteSettings:
        """Every named policy exists and its knobs are valid, every group's block fits its mode, the breaker
        knobs are known; raises ``ConfigError`` naming the key."""
        _check_policy(self.default_policy, self.default_knobs, "kvroute.default_policy", "kvroute.default_knobs")
        for group, gs in self.groups.items():
            where = f"kvroute.groups.{group}"
            if gs.hybrid is not None:
                if gs.policy is not None or gs.knobs:
                    raise ConfigError(f"{where}.hybrid", "give either hybrid: or policy:/knobs:, not both")
                if gs.kind != "auto":
                    raise ConfigError(f"{where}.kind", "a hybrid group mixes self-hosted and hosted deployments: "
                                                       "leave kind at auto")
                _check_policy("hybrid", gs.hybrid, f"{where}.hybrid")
            elif gs.policy is not None:
                _check_policy(gs.policy, gs.knobs, f"{where}.policy", f"{where}.knobs")
            elif gs.knobs:
                raise ConfigError(f"{where}.knobs", "knobs given without a policy (name the policy they are for)")
            if gs.mode == "precise":
                _check_precise(group, gs.precise, f"{where}.precise")
            elif gs.precise:
                raise ConfigError(f"{where}.precise", "only read with mode: precise")
        for i, rule in enumerate(self.rules):
            _check_policy(rule.policy, rule.knobs, f"kvroute.rules.{i}.policy", f"kvroute.rules.{i}.knobs")
        from kvroute.plugin.adapter.signals import breaker_config

        breaker_config(self.breaker)
        return self

    @field_validator("apps")
    @classmethod
    def _one_app_per_key(cls, v: dict[str, AppSettings]) -> dict[str, AppSettings]:
        from kvroute.plugin.adapter.key_hashes import key_map

        key_map(v)
        return v

    @model_validator(mode="after")
    def _key_map(self) -> KvrouteSettings:
        from kvroute.plugin.adapter.key_hashes import key_map

        self._app_keys = key_map(self.apps)
        return self

    @model_validator(mode="after")
    def _default_isolation(self) -> KvrouteSettings:
        """A group that does not set ``isolation`` gets ``default_isolation``."""
        default = self.default_isolation
        self.groups = {name: gs if "isolation" in gs.model_fields_set else gs.model_copy(update={"isolation": default})
                       for name, gs in self.groups.items()}
        return self

    @property
    def default_isolation(self) -> Isolation:
        """``isolation`` if set; else ``app`` when ``apps`` names several apps (one app must not learn from
        cached tokens or timing what another sent), else ``none`` (one organisation shares its prefixes)."""
        if self.isolation is not None:
            return self.isolation
        return "app" if len(self.apps) > 1 else "none"

    def isolation_reason(self) -> str:
        """Why ``default_isolation`` is what it is, for the startup line."""
        if self.isolation is not None:
            return "set by kvroute.isolation"
        return f"default: {len(self.apps)} apps" if len(self.apps) > 1 else "default: one organisation"

    @property
    def app_keys(self) -> dict[str, str]:
        """key hash (``sha256:<hex>``) -> app, from ``apps``."""
        return self._app_keys

    @property
    def billing_enabled(self) -> bool:
        """Asked for explicitly (the proxy also records by default: ``kvroute.plugin.adapter.billing_feed``)."""
        return (self.billing or bool(self.billing_db)) and (self.billing_db or "").lower() != "off"

    def group(self, name: str) -> GroupSettings:
        """The group's settings; a group the config does not name gets the defaults (one shared instance)."""
        found = self.groups.get(name)
        if found is not None:
            return found
        if self._default_group is None:
            self._default_group = GroupSettings(isolation=self.default_isolation)
        return self._default_group


class CliSettings(BaseSettings):
    """The CLI's own switches: ``KVROUTE_DEBUG`` (tracebacks instead of one-line errors), ``KVROUTE_CACHE_DIR``
    (where generated tiny models are cached; default ``~/.cache/kvroute``) and ``LITELLM_MASTER_KEY`` (the key
    ``kvroute status`` sends when ``--api-key`` is not given)."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="ignore", populate_by_name=True)

    debug: bool = False
    cache_dir: Path | None = None
    master_key: SecretStr | None = Field(None, validation_alias=AliasChoices("LITELLM_MASTER_KEY"))

    @field_validator("debug", mode="before")
    @classmethod
    def _lenient(cls, v: Any) -> bool:
        return str(v).strip().lower() in ("1", "true", "yes", "on")


def kvroute_environment() -> dict[str, str]:
    """The ``KVROUTE_*`` variables of this process (what ``kvroute check`` lists as overrides)."""
    return {k: v for k, v in os.environ.items() if k.startswith("KVROUTE_")}


def _check_database_url(value: str) -> None:
    """The billing database URL names a backend and a driver that are installed."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from kvroute.billing.db import database_url

    try:
        url = make_url(database_url(value))
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise ValueError(f"not a usable database URL ({type(exc).__name__}: {exc})") from None
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported database {url.get_backend_name()!r} (sqlite or postgresql)")
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ValueError(f"database driver {url.get_driver_name()!r} is not installed ({exc})") from None


def _check_precise(group: str, block: Mapping[str, Any], where: str) -> None:
    """Build (and discard) the group's precise feed: unknown keys, bad sources or a missing tokenizer stop here."""
    from kvroute.plugin.feeds.precise import group_from_config
    from kvroute.policies.precise_index import PreciseIndex

    try:
        built = group_from_config(group, block, PreciseIndex(), where=where)
    except ConfigError as exc:
        if exc.key.startswith("kvroute."):
            raise
        raise ConfigError(f"{where}.{exc.key}", exc.message) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(where, str(exc)) from None
    if not (built.feed is not None or built.tokenizer is not None or block.get("metrics")):
        raise ConfigError(where, "needs sources, a tokenizer/tokenize_url or metrics")
    with contextlib.suppress(Exception):
        built.stop()


_NESTED_ENV = ("groups", "rules", "breaker", "default_knobs")
# KVROUTE_* variables of CliSettings (the CLI's switches) and of the test suite.
_OTHER_ENV = ("KVROUTE_CACHE_DIR", "KVROUTE_DEBUG", "KVROUTE_BILLING_PROPERTY_EVENTS")
_OTHER_ENV_PREFIXES = ("KVROUTE_TEST_",)


def check_env(environ: Mapping[str, str]) -> None:
    """Every ``KVROUTE_*`` variable names a setting (here or billing's ``KVROUTE_BILLING_*``): a typo stops
    startup instead of being ignored (the first ``env_problems`` is raised)."""
    for problem in env_problems(environ):
        raise problem


def env_problems(environ: Mapping[str, str]) -> list[ConfigError]:
    """One ``ConfigError`` per ``KVROUTE_*`` variable that names no setting, with the one it may have meant."""
    from kvroute.billing.settings import BillingSettings

    fields = set(KvrouteSettings.model_fields) - {"prometheus_multiproc_dir"}
    billing = {"KVROUTE_BILLING_" + name.upper() for name in BillingSettings.model_fields}
    problems = []
    for name in sorted(environ):
        if not name.startswith("KVROUTE_") or name in _OTHER_ENV or name in billing:
            continue
        if name.startswith(_OTHER_ENV_PREFIXES):
            continue
        field = name[len("KVROUTE_"):].lower()
        top = field.split("__", 1)[0]
        if top not in fields or ("__" in field and top not in _NESTED_ENV):
            known = {"KVROUTE_" + f.upper() for f in fields} | set(_OTHER_ENV) | billing
            problems.append(ConfigError(name, "unknown kvroute setting" + did_you_mean(name, known)))
    return problems


def _key_of(loc: tuple[Any, ...]) -> str:
    return ".".join(["kvroute", *(str(p) for p in loc)]) if loc else "kvroute"


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the ``kvroute:`` block accepts beside the one at ``loc`` (a path of field names, group names and
    rule indexes), read from the settings models; [] where the path leaves them."""
    shape: Any = KvrouteSettings
    for part in loc[:-1]:
        while get_origin(shape) in (Union, UnionType):  # X | None: the model or container it names
            shape = next(a for a in get_args(shape) if a is not type(None))
        if isinstance(shape, type) and issubclass(shape, BaseModel):
            field = shape.model_fields.get(str(part))
            if field is None:
                return []
            shape = field.annotation
        elif get_origin(shape) in (dict, list):
            shape = get_args(shape)[-1]
        else:
            return []
    return list(shape.model_fields) if isinstance(shape, type) and issubclass(shape, BaseModel) else []


def validation_problem(err: Mapping[str, Any]) -> ConfigError:
    """One of pydantic's errors for the ``kvroute:`` block in kvroute's words, naming its key; an unknown key
    says which it may have meant."""
    loc = tuple(p for p in err.get("loc", ()) if p != "__root__")
    if err.get("type") == "extra_forbidden" and loc:
        return ConfigError(_key_of(loc), "unknown key" + did_you_mean(str(loc[-1]), _keys_at(loc)))
    return ConfigError(_key_of(loc), str(err.get("msg", "invalid")).removeprefix("Value error, "))


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
    """Settings from env, the YAML ``config_file`` finds (``KVROUTE_CONFIG``, else the proxy's own config
    ``proxy_config``, else ``CONFIG_FILE_PATH``'s), then ``overrides``."""
    check_env(kvroute_environment())
    try:
        first = KvrouteSettings(**overrides)
        block: dict[str, Any] = {}
        source = first.config or config_file(proxy_config)
        if source is not None:
            block = read_block(Path(source))
            block.pop("config", None)
        settings = KvrouteSettings(**{**block, **overrides}) if block else first
        if settings.redis_url == FROM_LITELLM:
            litellm_config = proxy_config or source
            proxy = _read_yaml(Path(litellm_config)) if litellm_config else {}
            settings = settings.model_copy(update={"redis_url": from_litellm(proxy, os.environ)})
    except ValidationError as exc:
        raise validation_problem(exc.errors()[0]) from exc
    return settings.check_policies()
