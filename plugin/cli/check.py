"""``kvroute check``: validate a LiteLLM proxy config for kvroute, offline, and optionally reach what it names.

``check_config(path)`` lists every problem it finds as ``"<key>: <what is wrong>"`` (the kvroute block through
the settings validation, the model list's ``model_info``, the callbacks line, fallbacks and rules naming groups
that do not exist, ``os.environ/`` references and ``KVROUTE_*`` overrides). ``probe(report)`` then reaches each
replica's ``api_base`` and ``metrics_url``, Redis and the billing database and says what answers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from pydantic import ValidationError

from kvroute.plugin.adapter.deployments import Backend, classify
from kvroute.plugin.extras import missing_modules
from kvroute.plugin.settings import (
    ENV_REF,
    KvrouteSettings,
    env_problems,
    kvroute_environment,
    load_settings,
    resolve_env_refs,
    validation_problem,
)
from kvroute.policies.errors import ConfigError

CALLBACK = "kvroute.plugin.kvroute_callback"
# KVROUTE_* variables of other settings classes (BillingSettings, CliSettings) and of the test harness.
OTHER_ENV = ("KVROUTE_BILLING_", "KVROUTE_DEBUG", "KVROUTE_CACHE_DIR", "KVROUTE_CALLBACK", "KVROUTE_TEST_")


@dataclass
class CheckReport:
    """What ``check_config`` found: problems (one line each), notes, and the parsed pieces ``probe`` needs."""

    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)
    settings: KvrouteSettings | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Probe:
    """One live reach: what was tried, whether it answered, and how."""

    target: str
    url: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.target}: {self.url} {self.detail}"


def _env_refs(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str) and value.startswith(ENV_REF):
        yield where, value[len(ENV_REF):]
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _env_refs(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _env_refs(v, f"{where}.{i}")


def _url_problem(value: Any) -> str | None:
    parsed = urlparse(str(value))
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        return f"not an http(s) URL: {value!r}"
    return None


def _check_env(report: CheckReport) -> None:
    fields = {name.upper() for name in KvrouteSettings.model_fields}
    environ = kvroute_environment()
    for name in sorted(environ):
        key = name[len("KVROUTE_"):].split("__", 1)[0]
        if key in fields and not name.startswith(OTHER_ENV):
            report.notes.append(f"{name} overrides kvroute.{key.lower()}")
    report.problems.extend(str(problem) for problem in env_problems(environ))


def _check_block(report: CheckReport, block: Mapping[str, Any]) -> None:
    """The kvroute block and env overrides through the settings validation: every field error, then the rest."""
    pruned = {k: v for k, v in block.items() if k != "config"}
    try:
        KvrouteSettings(**pruned)
    except ValidationError as exc:
        for err in exc.errors():
            report.problems.append(str(validation_problem(err)))
            _prune(pruned, tuple(err.get("loc", ())))
    else:
        try:
            report.settings = load_settings(report.path)
        except ConfigError as exc:
            if str(exc) not in report.problems:  # a KVROUTE_* typo: already listed by _check_env
                report.problems.append(str(exc))
        return
    try:  # the rest of the block, without the bad entries, so their neighbours are checked too
        report.settings = KvrouteSettings(**pruned)
        report.settings.check_policies()
    except ValidationError:
        pass
    except ConfigError as exc:
        report.problems.append(str(exc))


def _prune(block: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Drop the entry an error points at (a group or a top-level key) from a copy of the block."""
    if not loc:
        return
    top = block.get(loc[0])
    if len(loc) >= 2 and isinstance(top, Mapping) and loc[1] in top:
        block[loc[0]] = {k: v for k, v in top.items() if k != loc[1]}
    else:
        block.pop(loc[0], None)


def _check_model_list(report: CheckReport, model_list: Any) -> set[str]:
    if not isinstance(model_list, list) or not model_list:
        report.problems.append("model_list: missing or empty (kvroute routes among its deployments)")
        return set()
    groups: set[str] = set()
    seen: dict[str, int] = {}
    for i, entry in enumerate(model_list):
        where = f"model_list.{i}"
        if not isinstance(entry, Mapping):
            report.problems.append(f"{where}: must be a mapping")
            continue
        if not entry.get("model_name"):
            report.problems.append(f"{where}.model_name: missing")
        else:
            groups.add(str(entry["model_name"]))
        params = entry.get("litellm_params") or {}
        if isinstance(params, Mapping) and not params.get("model"):
            report.problems.append(f"{where}.litellm_params.model: missing")
        kind = report.settings.group(str(entry.get("model_name"))).kind if report.settings else "auto"
        try:
            backend = classify(entry, None, kind=kind, where=where)
        except ConfigError as exc:
            report.problems.append(str(exc))
            continue
        if backend.id in seen:
            report.problems.append(f"{where}.model_info.id: {backend.id!r} is also model_list.{seen[backend.id]}'s id")
        seen.setdefault(backend.id, i)
        if backend.self_hosted and not backend.api_base:
            report.problems.append(f"{where}.litellm_params.api_base: a self-hosted replica needs its URL")
        for key, value in (("litellm_params.api_base", backend.api_base), ("model_info.metrics_url",
                                                                            backend.metrics_url)):
            if value and (problem := _url_problem(value)):
                report.problems.append(f"{where}.{key}: {problem}")
        report.backends.append(backend)
    return groups


def _check_callbacks(report: CheckReport, doc: Mapping[str, Any]) -> None:
    settings = doc.get("litellm_settings") or {}
    callbacks = settings.get("callbacks") if isinstance(settings, Mapping) else None
    if isinstance(callbacks, str):
        callbacks = [callbacks]
    if not isinstance(callbacks, list) or CALLBACK not in callbacks:
        near = [c for c in callbacks or [] if isinstance(c, str) and "kvroute" in c]
        hint = f" (found {near[0]!r})" if near else ""
        report.problems.append(f'litellm_settings.callbacks: must list "{CALLBACK}"{hint}; without it LiteLLM '
                               "never calls kvroute")


def _check_groups(report: CheckReport, doc: Mapping[str, Any], groups: set[str]) -> None:
    if not groups:
        return
    s = report.settings
    if s is not None:
        for name in s.groups:
            if name not in groups:
                report.problems.append(f"kvroute.groups.{name}: no model_list entry has model_name {name!r}")
        for i, rule in enumerate(s.rules):
            if rule.match.group is not None and rule.match.group not in groups:
                report.problems.append(f"kvroute.rules.{i}.match.group: no model group {rule.match.group!r}")
    router = doc.get("router_settings") or {}
    fallbacks = router.get("fallbacks") if isinstance(router, Mapping) else None
    for i, item in enumerate(fallbacks or []):
        if not isinstance(item, Mapping):
            report.problems.append(f"router_settings.fallbacks.{i}: must be a mapping of group to groups")
            continue
        for src, targets in item.items():
            for name in [src, *(targets if isinstance(targets, list) else [targets])]:
                if str(name) not in groups:
                    report.problems.append(f"router_settings.fallbacks.{i}: no model group {name!r}")


def check_config(path: str | Path) -> CheckReport:
    """Every problem of the proxy config at ``path``, one line each (nothing is contacted)."""
    report = CheckReport(Path(path))
    try:
        raw = yaml.safe_load(report.path.read_text())
    except FileNotFoundError:
        report.problems.append("no such file")
        return report
    except (OSError, yaml.YAMLError) as exc:
        report.problems.append(f"cannot read it as YAML: {str(exc).splitlines()[0]}")
        return report
    if not isinstance(raw, Mapping):
        report.problems.append("top level must be a mapping")
        return report
    for where, name in _env_refs(raw, ""):
        if resolve_env_refs(ENV_REF + name) is None:
            report.problems.append(f"{where}: {ENV_REF}{name} is not set")
    doc = resolve_env_refs(raw)
    _check_env(report)
    block = doc.get("kvroute") or {}
    if not isinstance(block, Mapping):
        report.problems.append("kvroute: must be a mapping")
    else:
        _check_block(report, block)
    s = report.settings
    if s is not None and s.redis_url and not (s.hash_secret or s.hash_secret_file):
        report.problems.append("kvroute.hash_secret: required with redis_url (instances must share one secret and "
                               "it is never stored in Redis): set hash_secret, os.environ/NAME or hash_secret_file")
    groups = _check_model_list(report, doc.get("model_list"))
    _check_callbacks(report, doc)
    _check_groups(report, doc, groups)
    return report


def _get(target: str, url: str, timeout: float) -> Probe:
    import httpx

    try:
        resp = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return Probe(target, url, False, f"does not answer ({type(exc).__name__})")
    return Probe(target, url, resp.status_code < 500, f"answers {resp.status_code}")


def _redis(url: str, timeout: float) -> Probe:
    from kvroute.plugin.state.redis_url import shown

    secret_url, url = url, shown(url)
    if missing_modules("redis"):
        return Probe("redis", url, False, "not checked: needs the 'redis' extra: pip install 'kvroute[redis]'")
    import redis

    client = redis.Redis.from_url(secret_url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    except redis.RedisError as exc:
        return Probe("redis", url, False, f"does not answer ({type(exc).__name__})")
    finally:
        client.close()
    return Probe("redis", url, True, "answers PING")


def _database(url: str, timeout: float) -> Probe:
    if missing_modules("billing"):
        return Probe("billing db", url, False, "not checked: needs the 'billing' extra: pip install 'kvroute[billing]'")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from kvroute.billing.db import database_url

    full = make_url(database_url(url))
    shown = full.render_as_string(hide_password=True)
    if full.get_backend_name() == "sqlite":
        exists = bool(full.database) and Path(full.database).exists()
        return Probe("billing db", shown, True, "exists" if exists else "not created yet (created on first event)")
    args = {"connect_timeout": max(1, int(timeout))} if full.get_backend_name() == "postgresql" else {}
    engine = create_engine(full, connect_args=args)
    try:
        with engine.connect() as conn:
            conn.execute(text("select 1"))
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()
        return Probe("billing db", shown, False, f"does not answer ({reason[0] if reason else type(exc).__name__})")
    finally:
        engine.dispose()
    return Probe("billing db", shown, True, "answers")


def probe(report: CheckReport, timeout: float = 3.0) -> list[Probe]:
    """Reach every replica's ``api_base`` (``/models``) and ``metrics_url``, Redis and the billing database."""
    out: list[Probe] = []
    for b in report.backends:
        if b.api_base:
            out.append(_get(f"{b.id} api_base", b.api_base.rstrip("/") + "/models", timeout))
        if b.metrics_url:
            out.append(_get(f"{b.id} metrics_url", b.metrics_url, timeout))
    s = report.settings
    if s is not None and s.redis_url:
        out.append(_redis(s.redis_url, timeout))
    if s is not None and s.billing_db:
        try:
            ledger = s.ledger_location().db_url  # the proxy's ledger, resolved the way the proxy resolves it
        except ConfigError as exc:
            out.append(Probe("billing db", s.billing_db, False, str(exc)))
        else:
            if ledger is not None:
                out.append(_database(ledger, timeout))
    return out
