"""Decision benchmark: fingerprint + pick latency on a warm index, against baselines from the same run.

The timed prompts are turns of one conversation (the fingerprint continues the chain of the prefix it
remembers); ``fingerprint_unseen_p50_us`` times prompts the process never saw (the whole chain hashed).

Baselines: one xxh3 pass over the same prompt bytes (the floor any hashing router pays) and LiteLLM's
own ``Router.acompletion(mock_response=...)`` median with 8 deployments (what a request already costs).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import xxhash

from kvroute.policies import ChainKey, FingerprintConfig, Router, RouterConfig
from kvroute.policies.render import render_request

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
    "phi chi psi omega route cache prefix block token replica engine latency"
).split(" ")


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def chat_kwargs(tokens: int, seed: int, tail: int) -> dict[str, Any]:
    """A multi-turn chat of about ``tokens`` tokens (4 bytes each); ``tail`` varies only the last turn."""
    rng = random.Random(seed)
    total = tokens * 4
    system = _text(rng, min(total // 4, 8000))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    remaining = total - len(system)
    turn = 0
    while remaining > 600:
        chunk = min(remaining - 300, 4000 + rng.randrange(4000))
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": _text(rng, chunk)})
        remaining -= chunk
        turn += 1
    messages.append({"role": "user", "content": f"question {tail}: " + _text(random.Random(tail), 200)})
    return {"model": "bench", "messages": messages}


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def bench_case(tokens: int, nbackends: int, repeats: int) -> dict[str, Any]:
    """Time fingerprint + pick for one prompt size and backend count on a warm index, with keyed chains (a
    random server secret, as the plugin runs)."""
    router = Router(RouterConfig(fingerprint=FingerprintConfig(chain=ChainKey(os.urandom(32)))))
    backends = [f"replica-{i}" for i in range(nbackends)]
    # Warm the index: every backend holds other conversations; one holds this one's prefix.
    for i in range(nbackends * 2):
        req, dec = router.route(chat_kwargs(min(tokens, 8000), seed=1000 + i, tail=0), backends, group="bench")
        router.on_complete(req.request_id, cached_tokens=dec.matched_tokens)
    req, dec = router.route(chat_kwargs(tokens, seed=7, tail=0), backends, group="bench")
    router.on_complete(req.request_id, cached_tokens=0)
    prompts = [chat_kwargs(tokens, seed=7, tail=t) for t in range(1, 9)]
    samples: list[float] = []
    fp_samples: list[float] = []
    pick_samples: list[float] = []
    perf = time.perf_counter_ns
    for i in range(repeats):
        kwargs = prompts[i % len(prompts)]
        t0 = perf()
        request = router.fingerprint(kwargs)
        t_fp = perf()
        decision = router.pick(request, backends, group="bench")
        t1 = perf()
        samples.append((t1 - t0) / 1000.0)
        fp_samples.append((t_fp - t0) / 1000.0)
        pick_samples.append((t1 - t_fp) / 1000.0)
        router.on_complete(request.request_id, cached_tokens=decision.matched_tokens)
    # prompts this process never saw: no remembered prefix chain to continue (the whole chain is hashed)
    cold = [chat_kwargs(tokens, seed=10_000 + i, tail=0) for i in range(max(10, repeats // 30))]
    cold_samples = []
    for kwargs in cold:
        t0 = perf()
        router.fingerprint(kwargs)
        cold_samples.append((perf() - t0) / 1000.0)
    data = b"".join(render_request(prompts[0]).segments)
    hash_samples = []
    for _ in range(max(20, repeats // 5)):
        t0 = perf()
        xxhash.xxh3_64_intdigest(data)
        hash_samples.append((perf() - t0) / 1000.0)
    return {
        "prompt_tokens": tokens,
        "backends": nbackends,
        "p50_us": round(statistics.median(samples), 1),
        "p99_us": round(_percentile(samples, 0.99), 1),
        "fingerprint_p50_us": round(statistics.median(fp_samples), 1),
        "pick_p50_us": round(statistics.median(pick_samples), 1),
        "fingerprint_unseen_p50_us": round(statistics.median(cold_samples), 1),
        "hash_pass_us": round(statistics.median(hash_samples), 1),
        "matched_share": round(decision.matched_tokens / max(1, decision.prompt_tokens), 3),
    }


def litellm_acompletion_p50_us(calls: int = 120) -> float | None:
    """Median of LiteLLM ``Router.acompletion(mock_response=...)`` with 8 deployments, in µs."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        return None
    litellm.suppress_debug_info = True
    model_list = [
        {"model_name": "bench", "litellm_params": {"model": "openai/bench", "api_key": "x",
                                                   "api_base": f"http://127.0.0.1:9/{i}"},
         "model_info": {"id": f"d{i}"}}
        for i in range(8)
    ]
    router = litellm.Router(model_list=model_list)
    messages = chat_kwargs(8000, seed=7, tail=1)["messages"]

    async def run() -> list[float]:
        out = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            await router.acompletion(model="bench", messages=messages, mock_response=f"ok {i}")
            out.append((time.perf_counter_ns() - t0) / 1000.0)
        return out

    samples = asyncio.run(run())[10:]
    return round(statistics.median(samples), 1)


def run_decision_bench(tokens: Sequence[int], backends: Sequence[int], repeats: int,
                       litellm_baseline: bool = True) -> dict[str, Any]:
    cases = [bench_case(t, b, repeats if t <= 32000 else max(50, repeats // 3)) for t in tokens for b in backends]
    result: dict[str, Any] = {"cases": cases, "litellm_acompletion_p50_us": None}
    if litellm_baseline:
        result["litellm_acompletion_p50_us"] = litellm_acompletion_p50_us()
    ref = next((c for c in cases if c["prompt_tokens"] == 8000 and c["backends"] == 16), None)
    if ref and result["litellm_acompletion_p50_us"]:
        result["p50_8k_16_share_of_litellm"] = round(ref["p50_us"] / result["litellm_acompletion_p50_us"], 4)
    return result


def render_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    from kvroute.plugin.cli.output import fold, stdout_console

    table = Table(title="kvroute decision latency (fingerprint + pick, warm index)")
    for col in ("prompt tokens", "backends", "p50 µs", "p99 µs", "fingerprint µs", "pick µs",
                "fingerprint unseen µs", "xxh3 pass µs", "p50 / hash pass"):
        table.add_column(col, justify="right")
    for c in result["cases"]:
        ratio = c["p50_us"] / c["hash_pass_us"] if c["hash_pass_us"] else float("nan")
        table.add_row(str(c["prompt_tokens"]), str(c["backends"]), f"{c['p50_us']:.1f}", f"{c['p99_us']:.1f}",
                      f"{c['fingerprint_p50_us']:.1f}", f"{c['pick_p50_us']:.1f}",
                      f"{c['fingerprint_unseen_p50_us']:.1f}", f"{c['hash_pass_us']:.1f}", f"{ratio:.1f}×")
    console = stdout_console()
    console.print(fold(table))
    if result.get("litellm_acompletion_p50_us"):
        console.print(f"LiteLLM Router.acompletion(mock_response) p50: {result['litellm_acompletion_p50_us']:.0f} µs"
                      f"; kvroute 8k/16 p50 is {100 * result.get('p50_8k_16_share_of_litellm', 0):.2f}% of it")
