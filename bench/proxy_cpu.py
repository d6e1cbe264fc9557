"""Proxy CPU per request: plain LiteLLM vs LiteLLM with a do-nothing callback vs LiteLLM + kvroute.

Same 4 fake replicas (instant prefill and decode, so the proxies are the work), the same shared-prefix chat
requests, streamed or not, in interleaved rounds (the order rotates every round; with ``--orders 2``, the default,
every proxy is started again in the reverse order for as many rounds more, since the one started first costs up to 2
ms more per request on a 2-core VM). CPU is read per thread from ``/proc/*/task/*/schedstat`` (nanoseconds of CPU
actually run, so other load on the machine disturbs it far less than wall clock). Prints the medians over rounds of
the per-round ratios ``kvroute ÷ plain`` (goal ≤ 1.03) and ``noop ÷ plain`` (what LiteLLM spends on dispatching to
any callback with kvroute's hooks). ``--profile`` also samples each proxy with py-spy (installed into a throw-away
venv) and lists kvroute's own hot frames; ``--hook-timers`` adds a kvroute proxy whose hooks are timed
(``bench/proxy_hook_timers.py``) and reports kvroute's own CPU per hook call. Usage::

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python bench/proxy_cpu.py [--rounds 8] [--requests 200]
        [--stream] [--profile] [--hook-timers] [--json] [--before TREE] [--orders 1|2]

``--before TREE`` adds a ``kvroute_before`` proxy running the kvroute of another source tree (e.g. ``git archive
<commit> | tar -x -C TREE``) in the same interleaved rounds, so a change is priced against its parent under the same
noise (``kvroute_before_vs_plain`` beside ``kvroute_vs_plain``). ``--variant NAME:KEY=VALUE[,KEY=VALUE]`` adds a
kvroute proxy named ``kvroute_NAME`` with those ``KVROUTE_*`` settings (e.g. ``nobilling:KVROUTE_BILLING_DB=off``),
so a part of kvroute is priced by leaving it out in the same rounds. ``--identical N`` runs only N plain proxies of
one config, started one after another, and prints each start position's median: the bias the two start orders
cancel.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import cpu_seconds

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

HERE = Path(__file__).resolve().parent
NOOP_PARTS = ("noop_filter", "noop_pre_call", "noop_success", "noop_failure", "noop_stream")
TIMED_CALLBACK = "proxy_hook_timers.timed_callback"
#: the hooks one successful request calls once each (the stream chunk hook runs per chunk)
ONCE_PER_REQUEST = ("async_pre_call_hook", "async_filter_deployments", "async_pre_call_deployment_hook",
                    "async_post_call_success_deployment_hook", "async_post_call_success_hook",
                    "async_log_success_event")
PY_SPY_VENV = HERE.parent / ".kvroute" / "py-spy"
_KVROUTE_FRAME = re.compile(r"\((plugin|policies|billing|sim)/")
_IDLE = ("Condition.wait", "_worker (", "Runner.run (", "select (", "poll (")
#: instant prefill and decode: the proxies are the work
REPLICA = ReplicaOptions(capacity_tokens=65536, prefill_tokens_per_s=1e6, decode_ms=0.0, slots=64)
PROXY_ENV = {"LITELLM_LOG": "ERROR", "PYTHONPATH": str(HERE)}


def _body(i: int, prefixes: int, stream: bool) -> dict:
    system = f"System prompt {i % prefixes}: " + "shared instructions for the assistant " * 60
    body = {"model": "llama", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _load(proxy: ProxyProcess, n: int, offset: int, args: argparse.Namespace) -> int:
    """Send ``n`` requests, ``args.concurrency`` at a time; the number that failed."""
    sem = asyncio.Semaphore(args.concurrency)
    failed = 0
    async with httpx.AsyncClient(base_url=proxy.base_url, headers=proxy.headers, timeout=60,
                                 trust_env=False) as client:
        async def one(i: int) -> None:
            nonlocal failed
            async with sem:
                r = await client.post("/v1/chat/completions", json=_body(offset + i, args.prefixes, args.stream))
                if r.status_code != 200:
                    failed += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return failed


def _py_spy() -> Path:
    binary = PY_SPY_VENV / "bin" / "py-spy"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PY_SPY_VENV)], check=True)
        subprocess.run([str(PY_SPY_VENV / "bin" / "pip"), "install", "-q", "--require-hashes", "-r",
                        str(HERE.parent / "requirements" / "bench" / "py-spy.txt")], check=True)
    return binary


def own_frames(raw: Path, top: int = 15) -> dict:
    """From py-spy's collapsed stacks: busy samples, those in kvroute's own code (the deepest kvroute frame
    calls no LiteLLM code), and the hottest such frames."""
    busy = own = 0
    frames: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, chain = int(count), stack.split(";")
        if not chain[-1] or chain[-1].startswith(_IDLE):
            continue
        busy += n
        ours = [i for i, f in enumerate(chain) if _KVROUTE_FRAME.search(f)]
        if ours and not any("(litellm/" in f for f in chain[ours[-1] + 1:]):
            own += n
            frames[re.sub(r":\d+\)$", ")", chain[ours[-1]])] += n
    return {"busy_samples": busy, "kvroute_own_samples": own,
            "kvroute_own_share": round(own / busy, 4) if busy else None,
            "hot": [[f, n] for f, n in frames.most_common(top)]}


def measure(proxies: dict[str, ProxyProcess], args: argparse.Namespace,
            cpu: dict[str, list[float]] | None = None) -> tuple[dict[str, list[float]], int]:
    """Per-request CPU of every proxy in ``args.rounds`` interleaved rounds (the order rotates every round),
    appended to ``cpu``; returns it and the number of failed requests."""
    for proxy in proxies.values():  # warm-up: connections, lazy imports, first picks
        asyncio.run(_load(proxy, max(20, args.requests // 5), 10_000_000, args))
    cpu = cpu if cpu is not None else {v: [] for v in proxies}
    failed = 0
    for r in range(args.rounds):
        names = list(proxies)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            proxy = proxies[name]
            before = cpu_seconds([proxy.process.pid])
            failed += asyncio.run(_load(proxy, args.requests, r * args.requests, args))
            cpu.setdefault(name, []).append((cpu_seconds([proxy.process.pid]) - before) / args.requests)
    return cpu, failed


def per_proxy(cpu: dict[str, list[float]]) -> dict:
    """Each proxy's median CPU per request and its per-round figures, in ms."""
    return {"cpu_ms_per_request": {v: round(statistics.median(c) * 1000, 3) for v, c in cpu.items()},
            "rounds_ms": {v: [round(x * 1000, 2) for x in c] for v, c in cpu.items()}}


def summarize(cpu: dict[str, list[float]], failed: int, args: argparse.Namespace) -> dict:
    """Medians over every round (of every start order) and the medians of the per-round ratios to ``plain``."""
    out: dict = {"rounds": len(cpu["plain"]), "requests_per_round": args.requests, "stream": args.stream,
                 "concurrency": args.concurrency, "start_orders": args.orders, "failed": failed, **per_proxy(cpu)}
    for v in cpu:
        if v != "plain":
            out[f"{v}_vs_plain"] = round(statistics.median(a / b for a, b in zip(cpu[v], cpu["plain"],
                                                                                   strict=True)), 4)
    out["goal"] = 1.03
    return out


def profile(proxies: dict[str, ProxyProcess], args: argparse.Namespace, workdir: Path) -> dict:
    spy = _py_spy()
    out = {}
    for name, proxy in proxies.items():
        raw = workdir / f"{name}.txt"
        sampler = subprocess.Popen([str(spy), "record", "--pid", str(proxy.process.pid), "--rate", "200",
                                    "--format", "raw", "--nonblocking", "-o", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            asyncio.run(_load(proxy, args.requests * 2, 20_000_000, args))
        finally:
            sampler.send_signal(2)  # SIGINT: py-spy writes its file and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                sampler.wait(30)
        out[name] = own_frames(raw) if raw.exists() else {"error": "py-spy wrote nothing (ptrace not allowed?)"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--profile", action="store_true", help="also sample each proxy with py-spy")
    p.add_argument("--hooks", action="store_true",
                   help="also one proxy per kvroute hook, each alone and doing nothing (prices LiteLLM's dispatch)")
    p.add_argument("--orders", type=int, default=2, choices=(1, 2),
                   help="start the proxies in this many orders (2: as listed, then reversed; the rounds of both are "
                        "pooled): the proxy started first costs up to 2 ms more per request on a 2-core VM")
    p.add_argument("--hook-timers", action="store_true",
                   help="also a kvroute proxy with each hook timed (bench/proxy_hook_timers.py): kvroute's own CPU "
                        "per hook")
    p.add_argument("--json", action="store_true")
    p.add_argument("--before", type=Path, help="also a proxy running the kvroute of this source tree")
    p.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also a kvroute proxy kvroute_NAME with these KVROUTE_* settings (repeatable)")
    p.add_argument("--identical", type=int, default=0, metavar="N",
                   help="only N identical plain proxies: CPU per request by start position (the start-order bias)")
    args = p.parse_args()
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names) or {"kvroute_timed", "kvroute_before"} & set(names):
        p.error("each --variant needs a name of its own (not timed or before)")
    if args.identical:
        start_positions(args)
        return
    cpu: dict[str, list[float]] = {}
    failed = 0
    result_profile = None
    with contextlib.ExitStack() as fleet_stack:
        group = _group(fleet_stack)
        settings = {"num_retries": 0}
        env = PROXY_ENV
        configs = {"plain": build_proxy_config([group], kvroute=False, router_settings=settings),
                   "noop": build_proxy_config([group], kvroute=False, router_settings=settings,
                                              litellm_settings={"callbacks": ["proxy_noop_callback.noop_callback"]}),
                   "kvroute": build_proxy_config([group], kvroute=True, router_settings=settings)}
        for part in NOOP_PARTS if args.hooks else ():
            configs[part] = build_proxy_config([group], kvroute=False, router_settings=settings,
                                               litellm_settings={"callbacks": [f"proxy_noop_callback.{part}"]})
        # each proxy its own ledger folder: a drainer is a child of the proxy that started it and drains the folder
        envs = {name: {**env, "KVROUTE_DATA_DIR": fleet_stack.enter_context(_tempdir())} for name in configs}
        timer_files: list[Path] = []
        if args.hook_timers:
            timers_dir = Path(fleet_stack.enter_context(_tempdir()))
            configs["kvroute_timed"] = build_proxy_config([group], kvroute=False, router_settings=settings,
                                                          litellm_settings={"callbacks": [TIMED_CALLBACK]})
            envs["kvroute_timed"] = {**env, "KVROUTE_DATA_DIR": fleet_stack.enter_context(_tempdir())}
        if args.before is not None:
            configs["kvroute_before"] = configs["kvroute"]
            envs["kvroute_before"] = {**env, "PYTHONPATH": str(_tree_path(args.before, fleet_stack)),
                                      "KVROUTE_DATA_DIR": fleet_stack.enter_context(_tempdir())}
        for name, settings_env in args.variant:
            configs[name] = configs["kvroute"]
            envs[name] = {**env, **settings_env, "KVROUTE_DATA_DIR": fleet_stack.enter_context(_tempdir())}
        for k in range(args.orders):
            names = list(configs) if k == 0 else list(configs)[::-1]
            if args.hook_timers:  # one file per start order: each proxy's totals from its own start
                timer_files.append(timers_dir / f"hooks-{k}.json")
                envs["kvroute_timed"]["PROXY_HOOK_TIMERS"] = str(timer_files[-1])
            with contextlib.ExitStack() as stack:
                proxies = {name: stack.enter_context(ProxyProcess(configs[name], env=envs[name],
                                                                  inherit_kvroute_env=False)) for name in names}
                cpu, n_failed = measure(proxies, args, cpu)
                failed += n_failed
                if args.profile and k == 0:
                    result_profile = profile(proxies, args, Path(stack.enter_context(_tempdir())))
        hooks_ms = hook_cpu(timer_files) if timer_files else None  # before the temporary folder goes
    result = summarize(cpu, failed, args)
    if hooks_ms is not None:
        result["hook_cpu_ms"] = hooks_ms
    if result_profile is not None:
        result["profile"] = result_profile
    if args.json:
        print(json.dumps(result))
        return
    c = result["cpu_ms_per_request"]
    print(f"proxy CPU per {'streamed ' if args.stream else ''}request (median of {result['rounds']} interleaved "
          f"rounds × {args.requests}, {args.orders} start order(s)): plain {c['plain']} ms, "
          f"no-op callback {c['noop']} ms, kvroute {c['kvroute']} ms")
    print(f"kvroute ÷ plain {result['kvroute_vs_plain']} (goal ≤ 1.03); no-op ÷ plain {result['noop_vs_plain']}; "
          f"failed {result['failed']}")
    for part in (*NOOP_PARTS, "kvroute_before", "kvroute_timed", *(name for name, _ in args.variant)):
        if f"{part}_vs_plain" in result:
            print(f"{part} ÷ plain {result[f'{part}_vs_plain']}")
    if "hook_cpu_ms" in result:
        print(f"kvroute's own CPU per hook call (ms): {json.dumps(result['hook_cpu_ms'])}")
    for name, prof in result.get("profile", {}).items():
        print(f"py-spy {name}: {json.dumps(prof)}")


def start_positions(args: argparse.Namespace) -> None:
    """``--identical N``: N plain proxies of one config in interleaved rounds; the median CPU per request of each by
    the position it was started in (they differ only in that)."""
    with contextlib.ExitStack() as stack:
        config = build_proxy_config([_group(stack)], kvroute=False, router_settings={"num_retries": 0})
        proxies = {f"started_{i + 1}": stack.enter_context(ProxyProcess(config, env=PROXY_ENV,
                                                                        inherit_kvroute_env=False))
                   for i in range(args.identical)}
        cpu, failed = measure(proxies, args)
    out = {"rounds": args.rounds, "requests_per_round": args.requests, "stream": args.stream, "failed": failed,
           **per_proxy(cpu)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.identical} identical plain proxies, CPU per request by start position (median of {args.rounds} "
          f"rounds × {args.requests}): " + ", ".join(f"{k} {v} ms" for k, v in out["cpu_ms_per_request"].items()))


def _group(stack: contextlib.ExitStack) -> ModelGroup:
    """The model group every proxy serves: 4 fake replicas (``REPLICA``) that live as long as ``stack``."""
    fleet = stack.enter_context(Fleet(4, engine="fake", options=REPLICA, name_prefix="cpu"))
    return ModelGroup("llama", fleet.api_bases, engine="vllm")


def hook_cpu(files: list[Path]) -> dict[str, float]:
    """Mean thread CPU per call of each timed hook (ms), pooled over ``files`` (``proxy_hook_timers`` dumps), and
    ``per_request``: their sum over the hooks a non-streamed success calls once each."""
    calls: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    for f in files:
        if f.exists():
            for hook, (n, s) in json.loads(f.read_text()).items():
                calls[hook] += n
                seconds[hook] += s
    out = {hook: round(seconds[hook] / calls[hook] * 1000, 4) for hook in sorted(calls, key=seconds.__getitem__,
                                                                                    reverse=True)}
    out["per_request"] = round(sum(out[h] for h in ONCE_PER_REQUEST if h in out), 4)
    return out


def _variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VALUE[,KEY=VALUE]`` as (``kvroute_NAME``, its environment); only ``KVROUTE_*`` keys."""
    from kvroute.plugin.settings import check_env
    from kvroute.policies.errors import ConfigError

    name, _, pairs = text.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
    if not name.isidentifier() or not env or not all(k.startswith("KVROUTE_") for k in env):
        raise argparse.ArgumentTypeError(f"expected NAME:KVROUTE_KEY=VALUE[,KVROUTE_KEY=VALUE], got {text!r}")
    try:
        check_env(env)  # a typo stops here, not as a proxy that never comes up
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return f"kvroute_{name}", env


def _tree_path(tree: Path, stack: contextlib.ExitStack) -> Path:
    """A folder on which ``import kvroute`` finds ``tree`` (plus this bench folder, for the no-op callback)."""
    folder = Path(stack.enter_context(_tempdir()))
    (folder / "kvroute").symlink_to(tree.resolve(), target_is_directory=True)
    (folder / "proxy_noop_callback.py").symlink_to(HERE / "proxy_noop_callback.py")
    return folder


@contextlib.contextmanager
def _tempdir():
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvroute-proxy-cpu-") as d:
        yield d


if __name__ == "__main__":
    main()
