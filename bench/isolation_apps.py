"""What per-app isolation costs: the ``apps`` workload of ``bench/peers.py`` through a real kvroute proxy, each app
sending with its own key, once with ``isolation: app`` (the default when ``kvroute.apps`` names several apps) and
once with ``isolation: none``, on the same fake vLLM fleet (which honours ``cache_salt``).

    .venv/bin/python bench/isolation_apps.py [--replicas 4] [--apps 6] [--requests 120] [--rounds 2]

Prints, per setting and round, the cached share of prompt tokens (what the engines reported), TTFT p50/p90 and
the failures; the rounds alternate so a slow moment of this shared machine does not land on one setting only.
Every run salts its prompts, so no run reuses the cache another left behind. One-off prompts are their own app.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_workloads import Size, apps, replay, replica_capacity_tokens

from kvroute.plugin.adapter.key_hashes import key_hash
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config
from kvroute.plugin.dev.workloads import Conversation

MASTER = "sk-isolation-bench-master"
GROUP = "apps-bench"  # a name LiteLLM knows no tokenizer for (a "llama" group makes it fetch one from the network)


def app_key(flow: Conversation) -> str:
    """The API key of the flow's app (one-off prompts: app ``oneoff``)."""
    return f"sk-bench-app-{flow.system_id if flow.system_id >= 0 else 'oneoff'}"


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def one_run(base_urls: list[str], workload, isolation: str, workdir: Path) -> dict:
    keys = sorted({app_key(f) for f in workload.flows})
    config = build_proxy_config([ModelGroup(GROUP, base_urls)], master_key=MASTER)
    config["general_settings"]["custom_auth"] = "kvroute.plugin.adapter.app_keys.auth"
    settings = {"apps": {k.removeprefix("sk-bench-"): {"keys": [key_hash(k)]} for k in keys},
                "isolation": isolation, "groups": {GROUP: {"policy": "cache_aware"}}, "data_dir": str(workdir)}
    with ProxyProcess(config, kvroute_settings=settings, inherit_kvroute_env=False, workdir=workdir) as proxy:
        result = asyncio.run(replay(proxy.base_url, {}, GROUP, workload, uuid.uuid4().hex[:12],
                                    flow_headers=lambda f: {"Authorization": f"Bearer {app_key(f)}"}))
        line = next((ln for ln in proxy.log_text().splitlines() if "kvroute ready:" in ln), "")
    ok = [o for o in result.outcomes if o.ok]
    prompt = sum(o.prompt_tokens or 0 for o in ok)
    cached = sum(o.cached_tokens or 0 for o in ok)
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {"isolation": isolation, "requests": len(result.outcomes), "failed": len(result.outcomes) - len(ok),
            "cached_share": cached / prompt if prompt else 0.0, "ttft_p50_s": quantile(ttfts, 0.5),
            "ttft_p90_s": quantile(ttfts, 0.9), "startup": line[line.find("isolation"):].split(";")[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--apps", type=int, default=6)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path(".kvroute") / "isolation-bench")
    args = p.parse_args(argv)
    size = Size(apps=args.apps, app_requests=args.requests)
    workload = apps(size)
    capacity = replica_capacity_tokens(size, args.replicas)
    opts = ReplicaOptions(capacity_tokens=capacity)
    rows = []
    with Fleet(args.replicas, engine="fake", options=opts, name_prefix="iso-bench") as fleet:
        for r in range(args.rounds):
            for isolation in (("app", "none") if r % 2 == 0 else ("none", "app")):
                row = one_run(fleet.base_urls, workload, isolation, args.workdir / f"{isolation}-{r}")
                rows.append(row)
                print(f"round {r} isolation {isolation:4}: cached share {row['cached_share']:.1%}, TTFT p50 "
                      f"{row['ttft_p50_s'] * 1000:.0f} ms p90 {row['ttft_p90_s'] * 1000:.0f} ms, "
                      f"{row['failed']}/{row['requests']} failed ({row['startup']})", flush=True)
    for isolation in ("app", "none"):
        shares = [r["cached_share"] for r in rows if r["isolation"] == isolation]
        print(f"isolation {isolation}: cached share {', '.join(f'{s:.1%}' for s in shares)} "
              f"({args.replicas} fake replicas, {args.apps} apps, {workload.requests} requests a run, "
              f"{capacity} cache tokens a replica)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
