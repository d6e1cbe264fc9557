"""Trace loaders: Mooncake JSONL, kv-cache-tester sessions, Azure arrival CSVs and users' own request logs.

Everything is read from a path and reduced on load to sizes and block keys: no prompt text is kept
(request logs are hashed with ``kvroute.policies.Fingerprinter``, exactly as the plugin would).
Bad input raises ``InputError`` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
import random
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import xxhash

from kvroute.policies import Fingerprinter, InputError, chain_seed
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload, id_keys

MOONCAKE_BLOCK = 512
KVCT_BLOCK = 64


def _open_lines(path: Path) -> Iterator[tuple[int, str]]:
    if not path.exists():
        raise InputError(str(path), "file not found")
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                yield n, line


def _json_line(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{n}", f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}:{n}", "each line must be a JSON object")
    return obj


def _int_field(obj: Mapping[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise InputError(f"{where}.{key}", f"must be a non-negative number, got {v!r}")
    return int(v)


# --- Mooncake -------------------------------------------------------------------------------------------
def load_mooncake(path: str | Path, *, speedup: float = 1.0, limit: int | None = None) -> Workload:
    """Any Mooncake-format JSONL (``timestamp`` ms, ``input_length``, ``output_length``, prefix-chained
    ``hash_ids`` of 512-token blocks). The engines cache at the trace's 512-token granularity."""
    path = Path(path)
    if speedup <= 0:
        raise InputError("speedup", "must be positive")
    seed = chain_seed("mooncake", str(path.name))
    reqs: list[SimRequest] = []
    for n, line in _open_lines(path):
        obj = _json_line(path, n, line)
        where = f"{path}:{n}"
        ts = obj.get("timestamp", 0)
        if not isinstance(ts, int | float):
            raise InputError(f"{where}.timestamp", "must be a number (ms)")
        inp = _int_field(obj, "input_length", where)
        out = _int_field(obj, "output_length", where)
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise InputError(f"{where}.hash_ids", "must be a list of integers")
        keys = id_keys(ids[: inp // MOONCAKE_BLOCK], seed, chained_ids=True)
        reqs.append(SimRequest(max(1, inp), max(1, out), keys, ts / 1000.0 / speedup))
        if limit is not None and len(reqs) >= limit:
            break
    if not reqs:
        raise InputError(str(path), "no requests")
    t0 = min(r.arrival for r in reqs)
    for r in reqs:
        r.arrival -= t0
    reqs.sort(key=lambda r: r.arrival)
    return Workload(f"mooncake:{path.name}", MOONCAKE_BLOCK, reqs, [
        f"Mooncake trace {path.name}: {len(reqs)} requests, timestamps / {speedup:g}, 512-token blocks "
        "(engine cache granularity = trace granularity; the last partial block never hits)"])


# --- kv-cache-tester --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SessionArrivals:
    """Explicit session-arrival model: sessions start as a Poisson process with mean gap ``gap_s``; inside
    a session each request keeps its trace offset ``t`` (divided by ``speedup``)."""

    gap_s: float = 30.0
    speedup: float = 1.0
    seed: int = 0

    def describe(self) -> str:
        return (f"sessions start Poisson (mean gap {self.gap_s:g} s), requests at their trace offsets / "
                f"{self.speedup:g}")


def _kvct_sessions(path: Path, max_sessions: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
    def parse(name: str, raw: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{name}", f"not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
            raise InputError(f"{path}:{name}", "expected a session object with a 'requests' list")
        return obj

    count = 0
    if not path.exists():
        raise InputError(str(path), "file not found")
    if path.is_dir():
        for p in sorted(path.glob("*.json")):
            yield p.name, parse(p.name, p.read_bytes())
            count += 1
            if max_sessions is not None and count >= max_sessions:
                return
    elif tarfile.is_tarfile(path):
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(".json"):
                    continue
                fh = tar.extractfile(member)
                if fh is None:
                    continue
                yield member.name, parse(member.name, fh.read())
                count += 1
                if max_sessions is not None and count >= max_sessions:
                    return
    else:
        yield path.name, parse(path.name, path.read_bytes())


def _flatten(requests: list[Any], base_t: float, where: str) -> Iterator[tuple[float, dict[str, Any]]]:
    for i, r in enumerate(requests):
        if not isinstance(r, dict):
            raise InputError(f"{where}.requests[{i}]", "must be an object")
        t = float(r.get("t", 0.0)) + base_t
        if r.get("type") == "subagent" and isinstance(r.get("requests"), list):
            yield from _flatten(r["requests"], t, f"{where}.requests[{i}]")
        else:
            yield t, r


def load_kvct(path: str | Path, *, arrivals: SessionArrivals | None = None, max_sessions: int | None = 20,
              shared_prefix: bool = False, limit: int | None = None) -> Workload:
    """kv-cache-tester session files (a ``.json``, a folder, or ``traces.tar.gz`` read in place).

    Block ids are local to a session (sub-agents share it), so keys are chained per session. With
    ``shared_prefix`` the first ``ceil((tool_tokens + system_tokens) / 64)`` blocks of every session map to
    one common namespace — an assumption (Claude Code's tools and system prompt are mostly identical),
    not data, and reported as such.
    """
    path = Path(path)
    arrivals = arrivals or SessionArrivals()
    if arrivals.gap_s <= 0 or arrivals.speedup <= 0:
        raise InputError("arrivals", "gap_s and speedup must be positive")
    rng = random.Random(arrivals.seed)
    common = chain_seed("kvct", "shared-prefix")
    reqs: list[SimRequest] = []
    start = 0.0
    sessions = 0
    for name, obj in _kvct_sessions(path, max_sessions):
        where = f"{path}:{name}"
        bs = obj.get("block_size", KVCT_BLOCK)
        if bs != KVCT_BLOCK:
            raise InputError(f"{where}.block_size", f"expected {KVCT_BLOCK}, got {bs!r}")
        seed = chain_seed("kvct", name)
        shared_blocks = 0
        if shared_prefix:
            shared_blocks = math.ceil((float(obj.get("tool_tokens") or 0) + float(obj.get("system_tokens") or 0))
                                      / KVCT_BLOCK)
        start += rng.expovariate(1.0 / arrivals.gap_s)
        sessions += 1
        for t, r in sorted(_flatten(obj["requests"], 0.0, where), key=lambda x: x[0]):
            inp = _int_field(r, "in", where)
            out = _int_field(r, "out", where)
            ids = r.get("hash_ids") or []
            if not isinstance(ids, list):
                raise InputError(f"{where}.hash_ids", "must be a list")
            full = ids[: inp // KVCT_BLOCK]
            if shared_blocks:
                head = id_keys(range(min(shared_blocks, len(full))), common, chained_ids=False)
                tail = _chain_from(head[-1] if head else seed, full[len(head):])
                keys = head + tail
            else:
                keys = id_keys(full, seed, chained_ids=False)
            reqs.append(SimRequest(max(1, inp), max(1, out), keys, start + t / arrivals.speedup,
                                   session=name, app="kvct", cache_prefix_blocks=len(keys) or None))
            if limit is not None and len(reqs) >= limit:
                break
        if limit is not None and len(reqs) >= limit:
            break
    if not reqs:
        raise InputError(str(path), "no requests")
    reqs.sort(key=lambda r: r.arrival)
    notes = [f"kv-cache-tester: {sessions} sessions, {len(reqs)} requests; {arrivals.describe()}",
             "block ids are per-session; cross-session sharing "
             + ("SYNTHESISED for tool+system blocks (assumption)" if shared_prefix else "none (as in the data)")]
    return Workload(f"kvct:{path.name}", KVCT_BLOCK, reqs, notes)


def _chain_from(h: int, ids: list[Any]) -> list[int]:
    out = []
    for i in ids:
        h = xxhash.xxh3_64_intdigest((int(i) & ((1 << 64) - 1)).to_bytes(8, "little"), h)
        out.append(h)
    return out


# --- Azure arrival CSVs -------------------------------------------------------------------------------------
def _parse_time(v: Any, where: str) -> float:
    if isinstance(v, int | float):
        return float(v) / 1000.0 if v > 1e11 else float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return float(s) / 1000.0 if float(s) > 1e11 else float(s)
        except ValueError:
            pass
        try:
            s2 = s.replace("Z", "+00:00")
            if "." in s2:  # Azure writes 7 fractional digits; Python takes 6
                head, frac = s2.split(".", 1)
                digits = "".join(ch for ch in frac if ch.isdigit())
                rest = frac[len(digits):]
                s2 = f"{head}.{digits[:6]}{rest}"
            return datetime.fromisoformat(s2).timestamp()
        except ValueError:
            pass
    raise InputError(where, f"unreadable timestamp {v!r}")


def load_azure(path: str | Path, *, speedup: float = 1.0, prefix_groups: int = 0, prefix_tokens: int = 0,
               limit: int | None = None, seed: int = 0) -> Workload:
    """Azure LLM inference CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``): arrivals and lengths only.

    The data has no prefix information: by default prompts are unique; ``prefix_groups``/``prefix_tokens``
    synthesise a shared system prompt (one of G, uniform) — an assumption reported in the notes.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), "file not found")
    rng = random.Random(seed)
    kb = SegmentKeys(KVCT_BLOCK)
    reqs: list[SimRequest] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise InputError(f"{path}:1", f"expected columns {sorted(need)}, got {reader.fieldnames}")
        for n, row in enumerate(reader, 2):
            where = f"{path}:{n}"
            t = _parse_time(row["TIMESTAMP"], f"{where}.TIMESTAMP")
            try:
                ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except ValueError:
                raise InputError(where, "ContextTokens/GeneratedTokens must be integers") from None
            segs: list[tuple[int, int]] = []
            if prefix_groups > 0 and prefix_tokens > 0:
                shared = min(prefix_tokens, ctx)
                segs.append((-(rng.randrange(prefix_groups) + 1), shared))
                ctx_rest = ctx - shared
            else:
                ctx_rest = ctx
            if ctx_rest > 0:
                segs.append((n, ctx_rest))
            reqs.append(SimRequest(max(1, ctx), max(1, gen), kb.keys(segs), t / speedup))
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise InputError(str(path), "no rows")
    t0 = min(r.arrival for r in reqs)
    for r in reqs:
        r.arrival -= t0
    reqs.sort(key=lambda r: r.arrival)
    share = (f"SYNTHESISED shared prefix: {prefix_groups} groups x {prefix_tokens} tokens (assumption)"
             if prefix_groups and prefix_tokens else "no prefix data: prompts treated as unique")
    return Workload(f"azure:{path.name}", KVCT_BLOCK, reqs, [f"Azure trace {path.name}: {len(reqs)} requests; {share}"])


# --- users' own request logs --------------------------------------------------------------------------------
@dataclass(slots=True)
class LogRecord:
    """One logged request, parsed; ``body`` holds the OpenAI-style kwargs (dropped after hashing)."""

    line: int
    body: dict[str, Any]
    timestamp: float | None
    app: str
    output_tokens: int | None


def _maybe_json(v: Any) -> Any:
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def iter_log(path: str | Path) -> Iterator[LogRecord]:
    """Requests from a JSONL log: OpenAI-style bodies (optionally wrapped as ``{"body": ...}``, the Batch API
    format) or LiteLLM spend-log rows (``messages``/``proxy_server_request``, ``startTime``, ``metadata``)."""
    path = Path(path)
    for n, line in _open_lines(path):
        obj = _json_line(path, n, line)
        where = f"{path}:{n}"
        body: Any = obj.get("body") if isinstance(obj.get("body"), dict) else None
        if body is None:
            psr = _maybe_json(obj.get("proxy_server_request"))
            body = psr if isinstance(psr, dict) and (psr.get("messages") or psr.get("prompt")) else None
        if body is None:
            body = dict(obj)
        body = dict(body)
        for key in ("messages", "tools"):
            if key in body:
                body[key] = _maybe_json(body[key])
        if "messages" not in body and "prompt" not in body and "input" not in body:
            msgs = _maybe_json(obj.get("messages"))
            if msgs:
                body["messages"] = msgs
        if not (body.get("messages") or body.get("prompt") or body.get("input")):
            raise InputError(where, "no messages/prompt/input in this request")
        if not body.get("model") and obj.get("model"):
            body["model"] = obj.get("model")
        ts_raw = next((obj[k] for k in ("timestamp", "startTime", "created", "created_at", "time") if k in obj), None)
        ts = _parse_time(ts_raw, f"{where}.timestamp") if ts_raw is not None else None
        meta = _maybe_json(obj.get("metadata"))
        meta = meta if isinstance(meta, dict) else {}
        tags = _maybe_json(obj.get("request_tags")) or meta.get("tags") or []
        app = str(obj.get("app") or meta.get("app") or (tags[0] if isinstance(tags, list) and tags else "")
                  or obj.get("model_group") or body.get("model") or "default")
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        out = usage.get("completion_tokens") or obj.get("completion_tokens") or body.get("max_tokens") \
            or body.get("max_completion_tokens")
        yield LogRecord(n, body, ts, app, int(out) if isinstance(out, int | float) and out > 0 else None)


def cacheable_prefix(messages: Any) -> list[Any]:
    """Messages up to and including the last ``cache_control: ephemeral`` block (LiteLLM's rule)."""
    if not isinstance(messages, list):
        return []
    last: tuple[int, int | None] | None = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        cc = m.get("cache_control")
        if isinstance(cc, dict) and cc.get("type") == "ephemeral":
            last = (i, None)
        content = m.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if isinstance(block, dict) and isinstance(block.get("cache_control"), dict) \
                        and block["cache_control"].get("type") == "ephemeral":
                    last = (i, j)
    if last is None:
        return []
    i, j = last
    head = list(messages[:i])
    m = messages[i]
    if j is not None:
        m = {**m, "content": m["content"][: j + 1]}
    return [*head, m]


def load_request_log(path: str | Path, *, rate: float = 5.0, default_output: int = 256, limit: int | None = None,
                     seed: int = 0) -> Workload:
    """A user's own log, hashed on load (256-byte blocks ≈ 64 tokens, as the plugin fingerprints them).

    Timestamps are used when every record has one; otherwise arrivals are Poisson at ``rate``.
    """
    path = Path(path)
    fp = Fingerprinter()
    bt = fp.config.block_bytes / fp.config.bytes_per_token
    if bt != int(bt):
        raise InputError("fingerprint", "block_bytes / bytes_per_token must be a whole number of tokens")
    rng = random.Random(seed)
    reqs: list[SimRequest] = []
    stamps: list[float | None] = []
    for rec in iter_log(path):
        r = fp.from_kwargs(rec.body, app=rec.app, request_id=f"log-{rec.line}")
        prefix = cacheable_prefix(rec.body.get("messages"))
        cpb = None
        if prefix:
            cpb = len(fp.from_kwargs({**rec.body, "messages": prefix}, request_id="p").keys) or None
        reqs.append(SimRequest(max(1, r.prompt_tokens), rec.output_tokens or default_output, list(r.keys),
                               app=rec.app, session=r.session_key, cache_prefix_blocks=cpb))
        stamps.append(rec.timestamp)
        if limit is not None and len(reqs) >= limit:
            break
    if not reqs:
        raise InputError(str(path), "no requests")
    if all(s is not None for s in stamps):
        t0 = min(s for s in stamps if s is not None)
        for r, s in zip(reqs, stamps, strict=True):
            r.arrival = (s or t0) - t0
        timing = "log timestamps"
    else:
        t = 0.0
        for r in reqs:
            t += rng.expovariate(rate)
            r.arrival = t
        timing = f"Poisson {rate:g}/s (log has no timestamps on every line)"
    reqs.sort(key=lambda r: r.arrival)
    return Workload(f"log:{path.name}", int(bt), reqs, [
        f"request log {path.name}: {len(reqs)} requests hashed on load (no text kept), arrivals: {timing}"])
