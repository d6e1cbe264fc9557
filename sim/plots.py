"""PNG plots of a ``Comparison`` (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from kvroute.policies.errors import ConfigError
from kvroute.policies.registry import DEFAULT_POLICY
from kvroute.sim.runner import Comparison


def _mpl():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised only without matplotlib
        raise ConfigError("plots", "matplotlib is not installed (pip install matplotlib==3.11.2)") from exc
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


#: kvroute's own policies stand out in every plot: this colour, a thicker line, drawn above the others.
KVROUTE_COLOUR = "#d62728"
OTHER_COLOURS = ("#4c72b0", "#55a868", "#8172b2", "#937860", "#64b5cd", "#8c8c8c", "#ccb974", "#da8bc3",
                 "#2f4b7c", "#a05195", "#7f7f7f", "#17becf", "#bcbd22")
BAR_COLOUR = "#a9b7cf"


def is_kvroute(policy: str) -> bool:
    """kvroute's default policy (``cache_aware``) and its references (``kvroute_precise``, ...)."""
    return policy == DEFAULT_POLICY or policy.startswith("kvroute")


def label(policy: str) -> str:
    """The legend's name of a policy: kvroute's default says it is kvroute's."""
    return f"{policy} (kvroute)" if policy == DEFAULT_POLICY else policy


def line_style(policy: str, index: int) -> dict[str, object]:
    """Matplotlib keywords for one policy's line: kvroute's is red, 3 px and on top; the rest thin, muted."""
    if is_kvroute(policy):
        return {"color": KVROUTE_COLOUR, "linewidth": 3.0, "zorder": 10, "marker": "o", "markersize": 7}
    return {"color": OTHER_COLOURS[index % len(OTHER_COLOURS)], "linewidth": 1.2, "zorder": 2, "marker": "o",
            "markersize": 4, "alpha": 0.8}


def _bars(ax, names: list[str], values: list[float]) -> None:
    colours = [KVROUTE_COLOUR if is_kvroute(n) else BAR_COLOUR for n in names]
    bars = ax.bar(names, values, color=colours, zorder=2)
    for bar, name in zip(bars, names, strict=True):
        if is_kvroute(name):
            bar.set_edgecolor("black")
            bar.set_linewidth(1.5)
            bar.set_zorder(10)
    ax.tick_params(axis="x", rotation=30)
    for label in ax.get_xticklabels():
        if is_kvroute(label.get_text()):
            label.set_fontweight("bold")
            label.set_color(KVROUTE_COLOUR)


def figures(comp: Comparison) -> dict[str, object]:
    """Named matplotlib figures: hit rate per policy, TTFT p90 per policy, and TTFT p90 vs QPS for staged
    workloads; kvroute's bars and line are highlighted (``is_kvroute``). The caller closes them."""
    plt = _mpl()
    names = [m.policy for m in comp.metrics]
    out: dict[str, object] = {}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    _bars(ax, names, [m.hit_rate * 100 for m in comp.metrics])
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(f"{comp.workload.name}: hit rate per policy (kvroute in red)")
    out["hit_rate"] = fig
    fig, ax = plt.subplots(figsize=(8, 3.5))
    _bars(ax, names, [m.ttft_p90_s if math.isfinite(m.ttft_p90_s) else 0 for m in comp.metrics])
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.set_title(f"{comp.workload.name}: TTFT p90 per policy (kvroute in red)")
    out["ttft_p90"] = fig
    staged = [m for m in comp.metrics if m.stage_ttft_p90]
    if staged:
        fig, ax = plt.subplots(figsize=(8, 4))
        others = 0
        for m in staged:
            pts = [(float(lbl), v) for lbl, v in m.stage_ttft_p90 if _is_number(lbl)]
            style = line_style(m.policy, others)
            others += not is_kvroute(m.policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label(m.policy), **style)
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("TTFT p90 (s)")
        ax.set_yscale("log")
        legend = ax.legend(fontsize=8)
        for text in legend.get_texts():
            if text.get_text().endswith("(kvroute)") or text.get_text().startswith("kvroute"):
                text.set_fontweight("bold")
        ax.set_title(f"{comp.workload.name}: TTFT p90 vs QPS (kvroute in red)")
        out["ttft_p90_vs_qps"] = fig
    return out


def render(comp: Comparison) -> dict[str, bytes]:
    """Named PNGs of ``figures``."""
    plt = _mpl()
    out: dict[str, bytes] = {}
    for name, fig in figures(comp).items():
        out[name] = _png(fig)
        plt.close(fig)
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def write(images: dict[str, bytes], folder: Path, prefix: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in images.items():
        p = folder / f"{prefix}-{name}.png"
        p.write_bytes(data)
        paths.append(p)
    return paths
