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


def test_hook_timers_time_every_coroutine_hook_and_report_the_mean_per_call(tmp_path, monkeypatch):
    """``proxy_cpu --hook-timers``: each of kvroute's coroutine hooks is wrapped; a dump holds calls and thread CPU,
    and ``hook_cpu`` pools the dumps of both start orders into a mean per call."""
    import asyncio
    import time

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import proxy_cpu
    import proxy_hook_timers

    assert set(proxy_hook_timers.HOOKS) >= set(proxy_cpu.ONCE_PER_REQUEST)
    assert set(proxy_hook_timers.HOOKS) == {h for h in _overridden(KvrouteCallback)
                                            if h != "async_post_call_streaming_iterator_hook"}

    class Hooks:
        pass

    async def busy(*args, **kwargs):
        end = time.thread_time() + 0.0005
        while time.thread_time() < end:
            pass

    files = []
    for order in range(2):
        target = Hooks()
        for name in proxy_hook_timers.HOOKS:
            setattr(target, name, busy)
        files.append(tmp_path / f"hooks-{order}.json")
        timed = proxy_hook_timers.timed(target, str(files[-1]))

        async def calls(timed=timed):
            for _ in range(proxy_hook_timers.DUMP_EVERY):
                await timed.async_filter_deployments()

        asyncio.run(calls())
    out = proxy_cpu.hook_cpu(files)
    assert set(out) == {"async_filter_deployments", "per_request"}
    assert 0.5 <= out["async_filter_deployments"] < 50  # ms per call: 0.5 ms of busy thread CPU each
    assert out["per_request"] == out["async_filter_deployments"]


def test_a_variant_names_a_kvroute_proxy_and_refuses_settings_that_do_not_exist():
    """``proxy_cpu --variant``: ``NAME:KEY=VALUE[,KEY=VALUE]`` prices a part of kvroute by leaving it out; only real
    ``KVROUTE_*`` settings pass (a typo would otherwise surface as a proxy that never starts)."""
    import argparse

    import proxy_cpu

    assert proxy_cpu._variant("nobilling:KVROUTE_BILLING_DB=off") == ("kvroute_nobilling",
                                                                       {"KVROUTE_BILLING_DB": "off"})
    assert proxy_cpu._variant("two:KVROUTE_BILLING_DB=off,KVROUTE_METRICS_SCRAPE_INTERVAL_S=60")[1] == {
        "KVROUTE_BILLING_DB": "off", "KVROUTE_METRICS_SCRAPE_INTERVAL_S": "60"}
    for bad in ("nobilling", "no-billing:KVROUTE_BILLING_DB=off", "x:LITELLM_LOG=DEBUG", "x:KVROUTE_BILING_DB=off"):
        with pytest.raises(argparse.ArgumentTypeError):
            proxy_cpu._variant(bad)
