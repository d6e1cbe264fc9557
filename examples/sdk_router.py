"""kvroute with the LiteLLM SDK: the same callback as in the proxy, on a ``litellm.Router``.

Run three fake replicas first (``python -m kvroute.plugin.dev.fake_engine --port 8001`` ... ``8003``), or point
``API_BASES`` at real vLLM/SGLang servers, then: ``LITELLM_LOCAL_MODEL_COST_MAP=True python examples/sdk_router.py``.
The replicas are named as in ``examples/config.yaml`` (``replica-1`` on port 8001 ... ``replica-3``). Billing is
off here: in the SDK nothing is recorded unless the settings ask for it (``KVROUTE_BILLING=true``, or
``KVROUTE_BILLING_DB``), since the caller's own code, not a proxy, decides who pays.
"""

from __future__ import annotations

import asyncio
import os

import litellm

from kvroute.plugin import kvroute_callback

API_BASES = os.environ.get("API_BASES", "http://127.0.0.1:8001/v1,http://127.0.0.1:8002/v1,http://127.0.0.1:8003/v1")


def model_list() -> list[dict]:
    return [{"model_name": "llama",
             "litellm_params": {"model": "openai/fake-model", "api_base": base, "api_key": "none"},
             "model_info": {"id": f"replica-{i}", "engine": "vllm", "kv_capacity_tokens": 16384}}
            for i, base in enumerate(API_BASES.split(","), start=1)]


async def main() -> None:
    litellm.callbacks.append(kvroute_callback)
    if kvroute_callback.billing is None:
        print("billing off: the SDK records usage only when asked (KVROUTE_BILLING=true or KVROUTE_BILLING_DB)")
    router = litellm.Router(model_list=model_list(), num_retries=2)
    system = {"role": "system", "content": "You are a helpful assistant for the kvroute demo. " * 40}
    for turn in range(4):
        for chat in range(3):
            resp = await router.acompletion(
                model="llama", max_tokens=8,
                messages=[system, {"role": "user", "content": f"chat {chat}, turn {turn}"}],
                metadata={"app": "sdk-example", "workload": "agent"},
            )
            details = resp.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details else 0
            print(f"chat {chat} turn {turn}: {resp._hidden_params.get('model_id')} "
                  f"cached {cached}/{resp.usage.prompt_tokens}")
    await asyncio.sleep(0.5)  # let the success callbacks finish
    print(kvroute_callback.status()["backends"])


if __name__ == "__main__":
    asyncio.run(main())
