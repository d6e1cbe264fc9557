"""kvroute.sim: what-if fleet simulation and prompt lint ("would cache-aware routing help my traffic?").

The simulator drives the very same ``kvroute.policies.Router`` and policies the plugin uses, on a
simulated clock, against replicas with a block-granular prefix cache and a calibrated cost model.
"""

from kvroute.sim.engine import FleetConfig, RunResult, simulate
from kvroute.sim.metrics import PolicyMetrics, summarize
from kvroute.sim.presets import PRESETS, Preset, get_preset
from kvroute.sim.runner import Comparison, Verdict, compare
from kvroute.sim.workload import SimRequest, Workload

__all__ = ["PRESETS", "Comparison", "FleetConfig", "PolicyMetrics", "Preset", "RunResult", "SimRequest", "Verdict",
           "Workload", "compare", "get_preset", "simulate", "summarize"]
