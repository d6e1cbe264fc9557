"""The simulator's hedging replay: the proxy's Hedger on hosted routes with a heavy first-token tail."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from kvroute.policies.errors import ConfigError
from kvroute.policies.hedging import HedgeConfig
from kvroute.sim.cli import build_workload
from kvroute.sim.hedge_replay import replay_hedged
from kvroute.sim.hosted import HostedSpec, load_hosted, read_hosted

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hedge.yaml"


@pytest.fixture(scope="module")
def chat():
    return build_workload("chat", 64, {})


def test_hedging_cuts_the_tail_within_its_budget_and_books_the_losers(chat):
    routes = load_hosted(EXAMPLE).routes
    off = replay_hedged(chat, routes, None)
    config = HedgeConfig(budget=0.05, floor=2.0)
    on = replay_hedged(chat, routes, config)
    assert on.requests == off.requests > 1000
    assert off.hedges == 0 and off.hedge_cost == 0
    assert 0 < on.hedges <= config.floor + config.budget * on.requests  # the token bucket's bound
    assert 0 < on.hedge_wins <= on.hedges and on.hedge_cost > 0  # every hedge's loser costs its prompt
    assert on.cost == pytest.approx(off.cost + on.hedge_cost, rel=Decimal("0.2"))  # the answers cost about the same
    assert on.ttft_p50_s == off.ttft_p50_s  # the body is not touched (the primaries draw the same times)
    assert on.ttft_p99_s < off.ttft_p99_s and on.ttft_p999_s < off.ttft_p999_s


def test_no_tail_no_draw_and_the_files_stall_and_hedge_blocks_are_checked(chat):
    plain = HostedSpec("a", 0.3, 0.6, 60.0, Decimal("0.2"), Decimal("0.6"))
    assert replay_hedged(chat, [plain], None).ttft_p999_s < 3.0  # a lognormal body only
    doc = {"routes": {"a": {"price": {"input": "1", "output": "2"}, "ttft": {"p50": 0.3, "p90": 0.6},
                            "output_tok_s": 50, "stall": {"share": 0.1}}}, "hedge": {"budget": "5%"}}
    plan = read_hosted(doc)
    assert plan.routes[0].stall_share == 0.1 and plan.hedge == {"budget": "5%"}
    with pytest.raises(ConfigError, match="stall"):
        read_hosted({**doc, "routes": {"a": {**doc["routes"]["a"], "stall": {"share": 2}}}})
    with pytest.raises(ConfigError, match="hedge"):
        read_hosted({**doc, "hedge": 5})


def test_the_shipped_example_as_the_reference_documents_it():
    """``kvroute simulate -w chat -r 4 --hosted examples/hedge.yaml --hedge 5%``, checked from its own rows."""
    import json

    from typer.testing import CliRunner

    from kvroute.plugin.cli.cli import app

    r = CliRunner().invoke(app, ["simulate", "-w", "chat", "-r", "4", "--hosted", str(EXAMPLE), "--hedge", "5%",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    off, on = json.loads(r.stdout)["rows"]
    assert (off["setting"], on["setting"]) == ("off", "hedge 5%") and off["requests"] == on["requests"] > 1000
    assert off["hedges"] == 0 and on["hedges"] <= 2 + 0.05 * on["requests"]  # the file keeps floor's default
    assert on["extra_requests_pct"] == round(100 * on["hedges"] / on["requests"], 2)
    assert on["ttft_p50_ms"] == off["ttft_p50_ms"] and on["ttft_p999_ms"] < off["ttft_p999_ms"]
    assert 0 < on["extra_cost_pct"] < 10
    table = CliRunner().invoke(app, ["simulate", "-w", "chat", "-r", "4", "--hosted", str(EXAMPLE), "--hedge", "5%"])
    assert table.exit_code == 0 and "hedge 5%" in table.stdout
