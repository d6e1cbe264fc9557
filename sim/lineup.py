"""The simulator's lineup: importing this module registers every baseline (``baselines``) and 2026 anchor
(``anchors2026``) in the shared policy registry; the tuples say which names a comparison runs and in what order."""

from __future__ import annotations

import kvroute.sim.anchors2026
import kvroute.sim.baselines  # noqa: F401  (registers the 2025 baselines and the references)
from kvroute.policies import DEFAULT_POLICY

#: the anchors as their projects ship them in 2026 (``kvroute.sim.anchors2026``)
ANCHORS_2026 = ("smg_2026", "llmd_2026", "dynamo_2026", "vllm_sticky_least_loaded")

#: kvroute's default first, then every baseline, in the order reports list them.
DEFAULT_LINEUP = (DEFAULT_POLICY, "round_robin", "random", "least_load", "litellm_prompt_caching",
                  "sglang_cache_aware", "llmd_approx", "dynamo", *ANCHORS_2026, "oracle")

#: upper references reported beside the baselines (exact engine state; not counted as baselines to beat)
REFERENCES = ("oracle_ttft", "kvroute_precise")
#: policies that read ``sim/replica.py``'s block replicas (not a ``llamacpp`` preset's)
BLOCK_REPLICAS_ONLY = frozenset({"oracle", "oracle_ttft"})
