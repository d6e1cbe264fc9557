"""The calibration's simulator side: ``bench/peers_workloads.py``'s flows as the simulator's requests, and a run.

``sim_workload`` renders every turn as the replay sends it (the run's salt and the flow's system prompt, then the
user and assistant messages, in the chat template the tiny model and the fake engine share), tokenizes it with the
engine's tokenizer and gives each ``SimRequest`` the same token ids (llama.cpp reuses token prefixes), chained keys
of ``block_tokens``-token blocks (the routers' view), the tokens the engine generates where the next turn repeats
them, its flow's session key, and its start: an open-loop flow's first turn at the flow's start; with a concurrency
limit, the first ``concurrency`` flows at 0 and each later one after the last turn of the flow ``concurrency``
places before it (the replay's flows take the limit in order and, of one shape, end in about that order); every
later turn right after the turn before. Answers are the fake engine's llama.cpp answers (``LlamaCppModel.answer``:
``max_tokens`` one-token words; the real model's differ in content, not in length).

``simulate_cell`` runs one policy on a ``llamacpp`` fleet and returns the figures ``bench/peers.py`` measures: the
engines' cached share of prompt tokens and the client's TTFT p50/p90 (nearest rank). Both take the router's round
trip (``hop_s``, what ``bench/peers.py --hop`` measures per rival: its TTFT on an idle fleet less a replica's own): a
turn reaches the engines that long after the one before it completed, and each TTFT grows by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import xxhash
from peers_workloads import Workload, salt_of, session_key, system_content

from kvroute.plugin.dev.fake_engine import render_chat
from kvroute.plugin.dev.fake_llamacpp import LlamaCppModel
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.presets import get_preset
from kvroute.sim.workload import SimRequest, id_keys
from kvroute.sim.workload import Workload as SimWorkload

Tokenize = Callable[[str], Sequence[int]]
SALT = "0123456789abcdef"  # the replay's salts are 16 hex characters


def tiny_tokenizer() -> Tokenize:
    """The tiny model's tokenizer (what llama.cpp counts with on the bench)."""
    from tokenizers import Tokenizer

    from kvroute.plugin.dev.tiny_model import ensure_tiny_model

    tok = Tokenizer.from_file(str(ensure_tiny_model().tokenizer_json))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained keys of the full ``block_tokens``-token blocks of ``tokens``."""
    ids = [xxhash.xxh3_64_intdigest(repr(tuple(tokens[i:i + block_tokens])).encode())
           for i in range(0, len(tokens) // block_tokens * block_tokens, block_tokens)]
    return id_keys(ids, 0, chained_ids=False)


def sim_workload(workload: Workload, tokenize: Tokenize, block_tokens: int = 16, salt: str = SALT,
                 hop_s: float = 0.0) -> SimWorkload:
    """``workload``'s flows as simulator requests (module docstring); a request that follows another arrives
    ``hop_s`` after it completes (the router's round trip: its answer back to the client, the next request in)."""
    answer = LlamaCppModel.answer(workload.max_tokens)
    requests: list[SimRequest] = []
    last_of_flow: list[int] = []
    for n, flow in enumerate(workload.flows):
        messages = [{"role": "system", "content": system_content(salt, flow)}]
        previous: SimRequest | None = None
        for t, turn in enumerate(flow.turns):
            messages.append({"role": "user", "content": turn})
            tokens = tuple(tokenize(render_chat(messages)))
            if previous is not None and previous.tokens is not None and \
                    tokens[: len(previous.tokens)] == previous.tokens:  # the slot's generated tokens, repeated
                previous.answer_tokens = tokens[len(previous.tokens):len(previous.tokens) + workload.max_tokens - 1]
            req = SimRequest(prompt_tokens=len(tokens), output_tokens=workload.max_tokens,
                             keys=block_keys(tokens, block_tokens), session=session_key(salt, flow.conv_id),
                             tokens=tokens)
            if t > 0:
                req.follows, req.delay = len(requests) - 1, hop_s
            elif workload.concurrency and n >= workload.concurrency:
                req.follows, req.delay = last_of_flow[n - workload.concurrency], hop_s
            else:
                req.arrival = flow.start_s
            requests.append(req)
            previous = req
            messages.append({"role": "assistant", "content": answer})
        last_of_flow.append(len(requests) - 1)
    return SimWorkload(workload.name, block_tokens, requests,
                       notes=[f"{len(workload.flows)} flows of bench/peers_workloads.py, tokenized"])


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile, as ``bench/peers.py`` takes it (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def simulate_cell(workload: SimWorkload, policy: str, replicas: int, cache_tokens: int, cores: float | None,
                  background_cores: float = 0.0, hop_s: float | Sequence[float] = 0.0,
                  engine_cost: float = 1.0) -> dict:
    """One policy on ``replicas`` llama.cpp replicas ``engine_cost`` times slower than the preset: cached share,
    TTFT p50/p90 (ms, each with the router's round trip ``hop_s`` added: the client sees the first token that much
    later than the engine sends it; a sequence: each request's own, in the workload's order), requests."""
    fleet = FleetConfig(replicas, get_preset("llamacpp").slower(engine_cost), kv_tokens=cache_tokens, cores=cores,
                        background_cores=background_cores)
    result = simulate(workload, policy, fleet)
    done = [r for r in result.requests if r.first_token_at >= 0]
    prompt = sum(r.prompt for r in done)
    hops = [hop_s] * len(workload.requests) if isinstance(hop_s, (int, float)) else list(hop_s)
    ttfts = [r.first_token_at - r.arrival + hops[r.idx] for r in done]
    p50, p90 = nearest_rank(ttfts, 0.5), nearest_rank(ttfts, 0.9)
    return {"cached_share": round(sum(max(0, r.hit_tokens) for r in done) / prompt, 4) if prompt else 0.0,
            "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "ttft_p90_ms": None if p90 is None else round(p90 * 1000, 1),
            "requests": len(result.requests), "failed": len(result.requests) - len(done)}


def replayed(workload: Workload, tokenize: Tokenize, log: Sequence[Mapping], block_tokens: int = 16) \
        -> tuple[SimWorkload, list[float]]:
    """``workload`` as one measured run sent it (its ``requests_log``): the run's salt, and every request the log
    holds arriving at the engines when it reached them (sent, plus the router's way in as the relays clocked it),
    open loop; with each request's round trip (way in and way out, seconds) in the same order, for its TTFT. Given
    the arrivals, a router's picks and an engine's reuse are what a model must get right: which turn meets which
    prompt is then no lottery. Its TTFT is less telling: where the model runs a turn slower than llama.cpp did, the
    next turn of its flow arrives before it ends and queues behind it, which no client does."""
    salt = salt_of(str(log[0]["call_id"]), log[0]["flow"], int(log[0]["turn"])) if log else SALT
    base = sim_workload(workload, tokenize, block_tokens, salt)
    index, n = {}, 0
    for flow in workload.flows:
        for t in range(len(flow.turns)):
            index[(flow.conv_id, t)] = n
            n += 1
    requests, hops = [], []
    for q in sorted(log, key=lambda q: q["start_s"]):
        req = base.requests[index[(q["flow"], int(q["turn"]))]]
        way_in, way_out = (float(q.get(k) or 0.0) / 1000.0 for k in ("router_in_ms", "router_out_ms"))
        req.follows, req.delay, req.arrival = None, 0.0, float(q["start_s"]) + way_in
        requests.append(req)
        hops.append(way_in + way_out)
    return SimWorkload(workload.name, block_tokens, requests,
                       notes=[f"{len(requests)} requests of one measured run, at their measured arrivals"]), hops
