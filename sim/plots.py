"""PNG plots of a ``Comparison`` (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

import io
import math
from pathlib import Path

from kvroute.policies.errors import ConfigError
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


def render(comp: Comparison) -> dict[str, bytes]:
    """Named PNGs: hit rate per policy, TTFT p90 per policy, and TTFT p90 vs QPS for staged workloads."""
    plt = _mpl()
    names = [m.policy for m in comp.metrics]
    out: dict[str, bytes] = {}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, [m.hit_rate * 100 for m in comp.metrics], color="#4c72b0")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(f"{comp.workload.name}: hit rate per policy")
    ax.tick_params(axis="x", rotation=30)
    out["hit_rate"] = _png(fig)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, [m.ttft_p90_s if math.isfinite(m.ttft_p90_s) else 0 for m in comp.metrics], color="#dd8452")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.set_title(f"{comp.workload.name}: TTFT p90 per policy")
    ax.tick_params(axis="x", rotation=30)
    out["ttft_p90"] = _png(fig)
    plt.close(fig)
    staged = [m for m in comp.metrics if m.stage_ttft_p90]
    if staged:
        fig, ax = plt.subplots(figsize=(8, 4))
        for m in staged:
            pts = [(float(lbl), v) for lbl, v in m.stage_ttft_p90 if _is_number(lbl)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m.policy)
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("TTFT p90 (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(f"{comp.workload.name}: TTFT p90 vs QPS")
        out["ttft_p90_vs_qps"] = _png(fig)
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
