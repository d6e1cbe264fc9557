"""``kvroute simulate`` / ``kvroute lint`` through the real CLI entry point."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.plugin.cli.cli import app
from kvroute.sim.lineup import DEFAULT_LINEUP

SMALL = ["-p", "groups=6", "-p", "prompts_per_group=4", "-r", "3", "--preset", "llama-3.1-8b-a100", "-q"]
FIELDS = {"hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "output_tok_s", "hotspot",
          "cost_per_task", "wasted_prefill_tokens", "wasted_prefill_share", "floor_p50_s", "floor_p90_s",
          "gap_to_floor_p90"}


def test_simulate_json_has_exactly_the_issue_shape() -> None:
    res = CliRunner().invoke(app, ["simulate", "-w", "gsp", *SMALL, "--policies", "cache_aware,round_robin", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"workload", "replicas", "policies"}
    assert data["workload"] == "gsp" and data["replicas"] == 3
    assert set(data["policies"]) == {"cache_aware", "round_robin"}
    for row in data["policies"].values():
        assert set(row) == FIELDS
    assert data["policies"]["cache_aware"]["hit_rate"] > data["policies"]["round_robin"]["hit_rate"]


def test_simulate_default_lineup_table_csv_html_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib==3.11.2 (see requirements)")
    html, out_csv, plots = tmp_path / "r.html", tmp_path / "r.csv", tmp_path / "plots"
    res = CliRunner().invoke(app, ["simulate", "-w", "gsp", *SMALL, "--html", str(html), "--csv", str(out_csv),
                                   "--plots", str(plots)])
    assert res.exit_code == 0, res.output
    assert "Verdict" in res.stdout
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert [r["policy"] for r in rows][:2] == ["cache_aware", "round_robin"] and len(rows) == len(DEFAULT_LINEUP)
    assert {"wasted_prefill_tokens", "floor_p90_s", "gap_to_floor_p90"} <= set(rows[0])
    page = html.read_text()
    assert "Verdict" in page and "http://" not in page and "https://" not in page
    assert "data:image/png;base64," in page
    assert sorted(p.name for p in plots.iterdir()) == ["gsp-hit_rate.png", "gsp-ttft_p90.png"]


def test_simulate_errors_are_clear() -> None:
    r = CliRunner().invoke(app, ["simulate", "-w", "nope", "-q"])
    assert r.exit_code == 2 and "unknown workload" in r.output
    r = CliRunner().invoke(app, ["simulate", "-w", "gsp", "--policies", "cache_aware,bogus", *SMALL])
    assert r.exit_code == 2 and "unknown policy 'bogus'" in r.output
    r = CliRunner().invoke(app, ["simulate", "-w", "gsp", "-p", "nonsense=1", "-q"])
    assert r.exit_code == 2 and "param" in r.output
    r = CliRunner().invoke(app, ["simulate", "-w", "mooncake:/does/not/exist.jsonl", "-q"])
    assert r.exit_code == 2 and "not found" in r.output
    r = CliRunner().invoke(app, ["simulate", "-w", "gsp", *SMALL, "--usd-per-gpu-hour", "-1"])
    assert r.exit_code == 2 and "usd_per_gpu_hour" in r.output


def test_cost_per_task_scales_with_the_price() -> None:
    args = ["simulate", "-w", "gsp", *SMALL, "--policies", "round_robin", "--json"]
    one = json.loads(CliRunner().invoke(app, [*args, "--usd-per-gpu-hour", "1"]).stdout)
    two = json.loads(CliRunner().invoke(app, [*args, "--usd-per-gpu-hour", "2"]).stdout)
    c1, c2 = one["policies"]["round_robin"]["cost_per_task"], two["policies"]["round_robin"]["cost_per_task"]
    assert c1 > 0 and abs(c2 - 2 * c1) <= 2e-6


def test_lint_json(tmp_path: Path) -> None:
    log = tmp_path / "l.jsonl"
    rows = [{"model": "m", "messages": [{"role": "system", "content": f"Date: 2026-11-{i + 1:02d}. " + "stable " * 300},
                                        {"role": "user", "content": "hi"}]} for i in range(3)]
    log.write_text("\n".join(json.dumps(r) for r in rows))
    r = CliRunner().invoke(app, ["lint", str(log), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["findings"][0]["kind"] == "date" and data["tokens_lost"] > 0
    assert "stable stable" not in r.stdout
    r = CliRunner().invoke(app, ["lint", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "not found" in r.output


def test_simulate_reads_traces_and_logs_from_a_path(tmp_path: Path) -> None:
    moon = tmp_path / "m.jsonl"
    moon.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 1600, "output_length": 20,
                                          "hash_ids": [1, 2, 3, 10 + i]}) for i in range(12)))
    r = CliRunner().invoke(app, ["simulate", "-w", f"mooncake:{moon}", "-r", "2", "--policies",
                                 "cache_aware,round_robin", "--json", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["workload"] == "mooncake:m.jsonl"
    log = tmp_path / "l.jsonl"
    log.write_text("\n".join(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x " * 600 + str(i)}]})
                             for i in range(5)))
    r = CliRunner().invoke(app, ["simulate", "-w", f"log:{log}", "-r", "2", "--policies", "cache_aware", "--json",
                                 "-q", "-p", "rate=2"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policies"]["cache_aware"]["hit_rate"] > 0.5
