"""Through ``litellm.Router`` + the kvroute callback on fake engines over HTTP: the router learns the mean output
that ``kv_pressure`` charges from the completion tokens the engines report, and nothing before a completion."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from test_hooks_sdk import fleet, installed, litellm_flush
from test_repeats_stay_home_sdk import model_list

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings

pytestmark = pytest.mark.timeout(120)


async def test_the_mean_output_is_learned_from_the_completion_tokens_the_engines_report():
    import litellm

    cb = KvrouteCallback(KvrouteSettings().check_policies(), metrics=Metrics(CollectorRegistry()), mount=False)
    outputs = []
    async with fleet(2, capacity=65536) as servers:
        with installed(cb):
            router = litellm.Router(model_list=model_list(servers, 65536), num_retries=0)
            for i in range(3):
                messages = [{"role": "system", "content": "You answer briefly. " * 80},
                            {"role": "user", "content": f"question {i}"}]
                resp = await router.acompletion(model="llama", messages=messages, max_tokens=4 + 2 * i)
                outputs.append(resp.usage.completion_tokens)
            await litellm_flush(cb)
    load = cb.routers["llama"].state.load
    assert all(n > 0 for n in outputs), outputs
    expected = float(outputs[0])
    for n in outputs[1:]:
        expected += load.learn_rate * (n - expected)
    assert load.output_tokens() == pytest.approx(expected)
