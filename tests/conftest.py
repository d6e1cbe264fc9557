"""Suite-wide settings: offline LiteLLM, a hypothesis profile sized for a 2-core CI machine."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# "ci" (default) is derandomized so a landing never depends on luck; "dev" explores new examples each run.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
