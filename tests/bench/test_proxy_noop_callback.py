"""``bench/proxy_noop_callback.py`` prices LiteLLM's dispatch to kvroute's hooks, so it must override exactly the
hooks ``KvrouteCallback`` overrides (a hook missing there hides its dispatch cost in kvroute's figure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("litellm")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from litellm.integrations.custom_logger import CustomLogger  # noqa: E402
from proxy_noop_callback import NoopCallback  # noqa: E402

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback  # noqa: E402


def _overridden(cls: type) -> set[str]:
    """The ``CustomLogger`` methods ``cls`` (or a base between it and ``CustomLogger``) redefines."""
    return {name for name in dir(CustomLogger) if callable(getattr(CustomLogger, name, None))
            and not name.startswith("__") and getattr(cls, name) is not getattr(CustomLogger, name)}


def test_the_noop_callback_overrides_every_hook_kvroute_does():
    kvroute, noop = _overridden(KvrouteCallback), _overridden(NoopCallback)
    assert kvroute, "found no kvroute hooks: the comparison would prove nothing"
    assert kvroute == noop, {"kvroute only": sorted(kvroute - noop), "noop only": sorted(noop - kvroute)}
