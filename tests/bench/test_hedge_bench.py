"""bench/hedge_bench.py's pieces: the proxies' config, each setting's kvroute block, the quantiles it reports."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hedge_bench

from kvroute.plugin.settings import GroupSettings
from kvroute.policies.hedging import HedgeConfig


def test_one_hosted_group_of_three_providers_the_first_cheapest():
    cfg = hedge_bench.config(["http://a/v1", "http://b/v1", "http://c/v1"])
    ids = [d["model_info"]["id"] for d in cfg["model_list"]]
    prices = [d["litellm_params"]["input_cost_per_token"] for d in cfg["model_list"]]
    assert ids == ["provider-a", "provider-b", "provider-c"] and prices == sorted(prices)
    assert {d["model_name"] for d in cfg["model_list"]} == {"hosted"}


def test_each_setting_is_a_valid_group_block_hedging_only_when_budgeted():
    off, on = hedge_bench.settings(None), hedge_bench.settings(0.05)
    assert GroupSettings(**off["groups"]["hosted"]).hedge is None
    block = GroupSettings(**on["groups"]["hosted"]).hedge
    assert HedgeConfig.parse(block).budget == 0.05


def test_quantiles_are_nearest_rank_and_skip_streams_without_a_first_token():
    values = [0.01 * i for i in range(1, 101)] + [math.nan]
    assert hedge_bench.quantile(values, 0.99) == 0.99 and hedge_bench.quantile(values, 0.5) == 0.5
    assert math.isnan(hedge_bench.quantile([math.nan], 0.5))
