"""kvroute stands out in every plot: its own colour, a thicker line, drawn above every other policy (the oracle's
line used to hide it under the default colour cycle)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib==3.11.2 (see requirements)")

from matplotlib.colors import to_hex

from kvroute.sim import plots

POLICIES = ["cache_aware", "round_robin", "least_load", "oracle", "kvroute_precise"]


def comparison():
    metrics = [SimpleNamespace(policy=p, hit_rate=0.1 * i, ttft_p90_s=1.0 + i,
                               stage_ttft_p90=[("warmup", 1.0), ("3", 0.5 + i), ("10", 1.0 + i)])
               for i, p in enumerate(POLICIES)]
    return SimpleNamespace(workload=SimpleNamespace(name="ladder"), metrics=metrics)


@pytest.fixture
def figures():
    import matplotlib.pyplot as plt

    figs = plots.figures(comparison())
    yield figs
    for fig in figs.values():
        plt.close(fig)


def test_every_plot_is_made(figures):
    assert set(figures) == {"hit_rate", "ttft_p90", "ttft_p90_vs_qps"}


@pytest.mark.parametrize("name", ["hit_rate", "ttft_p90"])
def test_kvroute_bars_have_their_own_colour(figures, name):
    ax = figures[name].axes[0]
    by_policy = dict(zip(POLICIES, ax.patches, strict=True))
    for policy, bar in by_policy.items():
        kvroute = plots.is_kvroute(policy)
        assert (to_hex(bar.get_facecolor()) == plots.KVROUTE_COLOUR) is kvroute, policy
        if kvroute:
            assert bar.get_zorder() > max(b.get_zorder() for p, b in by_policy.items() if not plots.is_kvroute(p))


def test_kvroute_line_is_distinct_thicker_and_on_top(figures):
    drawn = figures["ttft_p90_vs_qps"].axes[0].get_lines()
    lines = {line.get_label().removesuffix(" (kvroute)"): line for line in drawn}
    assert set(lines) == set(POLICIES)
    assert plots.label("cache_aware") == "cache_aware (kvroute)"
    others = [line for p, line in lines.items() if not plots.is_kvroute(p)]
    for policy in ("cache_aware", "kvroute_precise"):
        line = lines[policy]
        assert to_hex(line.get_color()) == plots.KVROUTE_COLOUR
        assert line.get_linewidth() > max(o.get_linewidth() for o in others)
        assert line.get_zorder() > max(o.get_zorder() for o in others)
    assert all(to_hex(o.get_color()) != plots.KVROUTE_COLOUR for o in others)


def test_render_writes_pngs():
    images = plots.render(comparison())
    assert all(data.startswith(b"\x89PNG") for data in images.values())
