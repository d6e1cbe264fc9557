"""The spike workload, the four strategies' figures on it, ``kvroute simulate --hosted`` and the bench script."""

from __future__ import annotations

import itertools
import json
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.plugin.cli.cli import app
from kvroute.policies.errors import InputError
from kvroute.sim.engine import FleetConfig
from kvroute.sim.hosted import load_hosted
from kvroute.sim.presets import get_preset
from kvroute.sim.spend import replica_rate_card
from kvroute.sim.spike import AZURE_CONV, azure_spike, busiest_window
from kvroute.sim.strategies import STRATEGIES, check_targets, median_figures, run_strategies

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / AZURE_CONV
HOSTED = ROOT / "examples" / "hosted.yaml"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared Azure trace not present")
SMALL = {"before_s": 90.0, "spike_s": 90.0, "after_s": 90.0}


@pytest.mark.slow
@needs_trace
def test_spike_triples_the_trace_arrivals_inside_its_window_only() -> None:
    base, window = azure_spike(TRACE, factor=1, **SMALL)
    spiky, same = azure_spike(TRACE, factor=3, **SMALL)
    assert (window.start_s, window.end_s) == (same.start_s, same.end_s) == (90.0, 180.0)

    def counts(w):  # type: ignore[no-untyped-def]
        inside = sum(window.inside(r.arrival) for r in w.requests)
        return inside, len(w.requests) - inside

    (b_in, b_out), (s_in, s_out) = counts(base), counts(spiky)
    assert s_out == b_out  # the same arrivals outside
    assert 2.5 < s_in / b_in < 3.5  # ×3 inside (two more stretches of the same trace)
    assert [r.arrival for r in spiky.requests] == sorted(r.arrival for r in spiky.requests)
    assert {r.stage for r in spiky.requests} == {0, 1, 2} and "SYNTHESISED" in spiky.notes[1]


@needs_trace
def test_spike_sessions_resend_their_history_and_apps_share_system_prompts() -> None:
    w, _ = azure_spike(TRACE, factor=1, **SMALL)
    by_session: dict[str, list] = {}
    for r in w.requests:
        by_session.setdefault(r.session, []).append(r)
    long = [rs for rs in by_session.values() if len(rs) >= 2]
    assert long, "some sessions continue"
    for rs in long[:50]:
        for a, b in itertools.pairwise(rs):
            assert b.keys[: len(a.keys)] == a.keys and b.prompt_tokens > a.prompt_tokens
    firsts = {}
    for r in w.requests:
        firsts.setdefault(r.app, set()).add(r.keys[0])
    assert all(len(v) == 1 for v in firsts.values())  # one system prompt per app
    assert max(r.prompt_tokens + r.output_tokens for r in w.requests) <= 16_000 + 2048


def test_spike_refuses_bad_windows(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="factor"):
        azure_spike(TRACE, factor=0)
    short = tmp_path / "t.csv"
    short.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,2\n"
                     "2023-11-16 18:16:46.0,10,2\n")
    with pytest.raises(InputError, match="shorter"):
        azure_spike(short)


@pytest.mark.slow
@needs_trace
def test_strategies_on_a_small_spike_trade_latency_for_cost_as_expected() -> None:
    preset = get_preset("qwen3-32b-h100-tp2")
    plan = load_hosted(HOSTED)
    card = replica_rate_card(preset)
    runs = []
    for seed in (0, 1):
        w, window = azure_spike(TRACE, seed=seed, start_s=600.0 + 300 * seed, **SMALL)
        runs.append(run_strategies(w, window, FleetConfig(2, preset), plan.routes, card,
                                   target_s=plan.ttft_target_s, seed=seed))
    figs = {f.strategy: f for f in median_figures(runs)}
    assert list(figs) == list(STRATEGIES)
    s, f, a, h = (figs[n] for n in STRATEGIES)
    assert s.hosted_share == 0 and a.hosted_share == 1 and 0 < h.hosted_share < 1
    assert h.meet_in > s.meet_in and h.meet_in > f.meet_in  # overflow by prediction beats queueing or errors
    assert h.cost_per_1k < a.cost_per_1k and s.cost_per_1k < a.cost_per_1k
    assert h.hosted_share_in > h.hosted_share  # it overflows in the spike, not outside it
    checks = check_targets(figs)
    assert [c.name for c in checks][1:] == ["cheaper than always-hosted",
                                           "within 10 % of self-hosted-only cost outside the spike"]
    assert all(isinstance(x.cost_per_1k, Decimal) for x in figs.values())


def test_busiest_window_finds_the_burst() -> None:
    from kvroute.sim.workload import SimRequest, Workload
    reqs = [SimRequest(10, 1, [], float(t)) for t in range(0, 100, 10)] + \
        [SimRequest(10, 1, [], 50 + i * 0.1) for i in range(30)]
    window = busiest_window(Workload("x", 16, sorted(reqs, key=lambda r: r.arrival)), 5.0)
    assert window.start_s <= 50.0 and window.end_s >= 52.9


def _log(tmp_path: Path, n: int = 60) -> Path:
    log = tmp_path / "requests.jsonl"
    system = "You are the support assistant of a product. " * 60
    log.write_text("\n".join(json.dumps({"model": "m", "user": "acme", "timestamp": 1_700_000_000 + (i if i < 30 else
                                         30 + (i - 30) * 0.05), "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": f"question {i} " * 40}]})
                             for i in range(n)) + "\n")
    return log


def test_simulate_hosted_prints_the_strategy_table_as_json_and_csv(tmp_path: Path) -> None:
    log = _log(tmp_path)
    args = ["simulate", "-w", f"log:{log}", "-r", "1", "-q", "--hosted", str(HOSTED)]
    res = CliRunner().invoke(app, [*args, "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data["strategies"]) == set(STRATEGIES) and data["target_s"] == 2.0
    for row in data["strategies"].values():
        assert {"ttft_p90_in_s", "ttft_p90_out_s", "meet_in", "cost_per_1k", "hosted_share"} <= set(row)
        Decimal(row["cost_per_1k"])  # money as a decimal string
    assert data["strategies"]["always_hosted"]["hosted_share"] == 1.0
    assert next(t["name"] for t in data["targets"]).startswith("meets target")
    csv_out = CliRunner().invoke(app, [*args, "--format", "csv", "--strategies", "self_hosted,hybrid"])
    assert csv_out.exit_code == 0, csv_out.output
    lines = csv_out.stdout.strip().splitlines()
    assert lines[0].startswith("strategy,") and [ln.split(",")[0] for ln in lines[1:]] == ["self_hosted", "hybrid"]
    table = CliRunner().invoke(app, [*args, "--spike-window", "25:40"])
    assert table.exit_code == 0, table.output
    assert "hybrid" in table.stdout and "25-40 s" in table.stdout


@pytest.mark.parametrize(("extra", "words"), [
    (["--strategies", "hosted_only"], "hosted_only"),
    (["--policies", "cache_aware"], "--policies"),
    (["--spike-window", "9:3"], "--spike-window"),
])
def test_simulate_hosted_bad_options_exit_2_with_one_line(tmp_path: Path, extra: list[str], words: str) -> None:
    res = CliRunner().invoke(app, ["simulate", "-w", f"log:{_log(tmp_path, 5)}", "-r", "1", "-q", "--hosted",
                                   str(HOSTED), *extra])
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output


def test_simulate_hosted_bad_file_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "h.yaml"
    bad.write_text("routes:\n  fast: {price: {input: '1', output: '2'}, ttft: {p50: 1, p90: 2}, output_tok_s: 10, "
                   "rpm: -5}\n")
    res = CliRunner().invoke(app, ["simulate", "-w", f"log:{_log(tmp_path, 5)}", "-r", "1", "-q", "--hosted",
                                   str(bad)])
    assert res.exit_code == 2 and "h.yaml" in res.output and "rpm" in res.output
    knobs = tmp_path / "k.yaml"
    knobs.write_text(HOSTED.read_text() + "hybrid: {enter_ratio: 0.2, leave_ratio: 0.9}\n")
    res = CliRunner().invoke(app, ["simulate", "-w", f"log:{_log(tmp_path, 5)}", "-r", "1", "-q", "--hosted",
                                   str(knobs)])
    assert res.exit_code == 2 and "leave_ratio" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["simulate", "-w", "gsp", "-r", "1", "-q", "--strategies", "hybrid"])
    assert res.exit_code == 2 and "--hosted" in res.output


@pytest.mark.slow
@needs_trace
def test_bench_quick_json_reports_every_strategy_and_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import hybrid_spike
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert hybrid_spike.main(["--quick", "--json", "--replicas", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["strategies"]) == {*STRATEGIES, "hybrid_no_margin"} and data["replicas"] == 2
    assert len(data["targets"]) == 3 and len(data["second_hybrid_targets"]) == 3
    assert data["self_hosted_card"]["gpu_hour"] == "2.50"
