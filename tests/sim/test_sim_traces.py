"""Trace loaders on small generated fixtures, and on the shared real traces when they are present."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from kvroute.policies import InputError
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.metrics import summarize
from kvroute.sim.presets import get_preset
from kvroute.sim.traces import SessionArrivals, cacheable_prefix, load_azure, load_kvct, load_mooncake, load_request_log

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SECRET = "Sup3rSecretPromptText"


def _mooncake(tmp_path: Path) -> Path:
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 500, "input_length": 1300, "output_length": 7, "hash_ids": [1, 2, 9]},
            {"timestamp": 1500, "input_length": 300, "output_length": 2, "hash_ids": [4]}]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_mooncake_keys_and_times(tmp_path: Path) -> None:
    w = load_mooncake(_mooncake(tmp_path), speedup=2.0)
    assert w.block_tokens == 512
    a, b, c = w.requests
    assert [r.arrival for r in w.requests] == [0.0, 0.25, 0.75]
    assert len(a.keys) == 2 and a.keys == b.keys[:2]  # 1100 // 512 = 2 full blocks; partial never keyed
    assert c.keys == []  # 300 tokens: no full block
    res = simulate(w, "cache_aware", FleetConfig(2, get_preset("qwen3-32b-h100-tp2")))
    assert len(res.requests) == 3


def test_mooncake_bad_lines_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\nnot json\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2"):
        load_mooncake(p)
    p.write_text('{"timestamp": 0, "input_length": -1, "output_length": 1}\n')
    with pytest.raises(InputError, match="input_length"):
        load_mooncake(p)
    with pytest.raises(InputError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")


def _kvct_session(name: str) -> dict:
    return {"id": name, "block_size": 64, "hash_id_scope": "local", "tool_tokens": 128, "system_tokens": 64,
            "requests": [
                {"t": 0, "type": "n", "in": 640, "out": 10, "hash_ids": list(range(10))},
                {"t": 20, "type": "subagent", "requests": [{"t": 1, "type": "n", "in": 200, "out": 4,
                                                             "hash_ids": [0, 1, 2, 77]}]},
                {"t": 30, "type": "n", "in": 700, "out": 10, "hash_ids": list(range(11))}]}


def test_kvct_tar_sessions_and_arrival_model(tmp_path: Path) -> None:
    tar_path = tmp_path / "traces.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in ("s1.json", "s2.json"):
            data = json.dumps(_kvct_session(name)).encode()
            info = tarfile.TarInfo(f"traces/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    w = load_kvct(tar_path, arrivals=SessionArrivals(gap_s=10.0))
    assert len(w.requests) == 6 and w.block_tokens == 64
    assert any("Poisson" in n for n in w.notes)
    by = {}
    for r in w.requests:
        by.setdefault(r.session, []).append(r)
    s1 = sorted(by["traces/s1.json"], key=lambda r: r.arrival)
    assert s1[1].arrival - s1[0].arrival == pytest.approx(21.0)  # sub-agent t is relative to its entry
    assert s1[2].keys[:10] == s1[0].keys  # later turn re-sends the prefix
    # ids are local: two sessions with the same ids share nothing ...
    s2 = sorted(by["traces/s2.json"], key=lambda r: r.arrival)
    assert s1[0].keys[0] != s2[0].keys[0]
    # ... unless the tool+system prefix is synthesised as shared (ceil(192 / 64) = 3 blocks)
    shared = load_kvct(tar_path, shared_prefix=True)
    heads = {tuple(r.keys[:3]) for r in shared.requests if len(r.keys) >= 3}
    assert len(heads) == 1 and any("SYNTHESISED" in n for n in shared.notes)


def test_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,640,10\n"
                 "2023-11-16 18:17:04.9799600,700,8\n")
    w = load_azure(p)
    assert [r.arrival for r in w.requests] == pytest.approx([0.0, 1.0])
    assert w.requests[0].keys[0] != w.requests[1].keys[0]
    shared = load_azure(p, prefix_groups=1, prefix_tokens=512)
    assert shared.requests[0].keys[:8] == shared.requests[1].keys[:8]
    p.write_text("when,ctx\n1,2\n")
    with pytest.raises(InputError, match="expected columns"):
        load_azure(p)


def _log(tmp_path: Path) -> Path:
    sys_prompt = "You are a careful assistant. " * 40 + SECRET
    rows = [
        {"model": "m", "timestamp": 1_700_000_000, "messages": [
            {"role": "system",
             "content": [{"type": "text", "text": sys_prompt, "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": f"question {i} " * 30}], "max_tokens": 50} for i in range(3)]
    rows.append({"request_id": "x", "startTime": "2023-11-16T18:17:05Z", "model": "m",
                 "messages": json.dumps([{"role": "user", "content": "spend log prompt " * 40}]),
                 "completion_tokens": 12, "metadata": {"app": "support"}})
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_request_log_is_hashed_and_keeps_no_text(tmp_path: Path) -> None:
    w = load_request_log(_log(tmp_path))
    assert len(w.requests) == 4
    assert SECRET not in repr(w) and "question" not in repr(w)
    a, b = w.requests[0], w.requests[1]
    assert a.cache_prefix_blocks and a.keys[: a.cache_prefix_blocks] == b.keys[: a.cache_prefix_blocks]
    assert a.output_tokens == 50 and w.requests[3].output_tokens == 12 and w.requests[3].app == "support"
    res = simulate(w, "litellm_prompt_caching", FleetConfig(2, get_preset("qwen3-32b-h100-tp2")))
    assert summarize(res, w, FleetConfig(2, get_preset("qwen3-32b-h100-tp2"))).completed == 4


def test_request_log_errors(tmp_path: Path) -> None:
    p = tmp_path / "l.jsonl"
    p.write_text('{"model": "m"}\n')
    with pytest.raises(InputError, match=r"l.jsonl:1"):
        load_request_log(p)


def test_cacheable_prefix_follows_litellm_rule() -> None:
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "b"}]},
            {"role": "user", "content": "c"}]
    pre = cacheable_prefix(msgs)
    assert len(pre) == 2 and pre[1]["content"] == [msgs[1]["content"][0]]
    assert cacheable_prefix([{"role": "user", "content": "x"}]) == []


# --- real traces (skipped when the trace files are absent) -----------------------------------------------
def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present (shared traces are not part of the repository)")
    return path


def test_real_mooncake_trace_loads_and_simulates() -> None:
    w = load_mooncake(_need(SHARED / "mooncake" / "synthetic_trace.jsonl"), limit=400)
    assert len(w.requests) == 400
    fleet = FleetConfig(8, get_preset("qwen3-32b-h100-tp2"))
    m_ca = summarize(simulate(w, "cache_aware", fleet), w, fleet)
    m_rr = summarize(simulate(w, "round_robin", fleet), w, fleet)
    assert m_ca.hit_rate > m_rr.hit_rate


def test_real_kvct_tarball_reads_in_place() -> None:
    w = load_kvct(_need(SHARED / "kv-cache-tester" / "traces.tar.gz"), max_sessions=2, limit=60)
    assert 0 < len(w.requests) <= 60 and w.block_tokens == 64


def test_real_azure_csv() -> None:
    w = load_azure(_need(SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"), limit=500)
    assert len(w.requests) == 500 and w.requests[-1].arrival > 0
