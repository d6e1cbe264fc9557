"""Where kvroute's placements and a peer's differ, and what each difference cost, request by request.

    .venv/bin/python bench/peers.py --fleet llamacpp --fresh-fleet --rival kvroute --rival smg-ca --json > run.json
    .venv/bin/python bench/peers_diff.py run.json [--peer smg-ca] [--workload apps] [--requests]

Reads a ``bench/peers.py --json`` result (each run keeps, per request, the replica that answered, the engine's cached
and prompt tokens, TTFT, what the fleet held of the prompt when it was sent — ``peers_waste.holdings`` — and, for
kvroute, its decision-log line: what the index believed each replica held and its load). With ``--fresh-fleet``
every rival of a repeat replays the same prompts on freshly started replicas, so request ``(flow, turn)`` is the
same request in both runs. Every request where either router got fewer cached tokens than the fleet could give
(``obtainable``: the most any replica held of the prompt, its own replica's earlier requests included) is put in
one cause:

- ``first turns split``: a session's first request went elsewhere while another replica was still computing its
  prefix (held only by requests in flight);
- ``later turn split``: the same for a later turn;
- ``spill on load``: another replica held more of it through finished requests, and kvroute's index knew (its
  chosen replica's believed match was below another's): the policy chose to leave the holder;
- ``index missed a holder``: another replica held more through finished requests, but kvroute's index believed
  no replica held more than the chosen one (it had dropped those blocks, or never learned the tail);
- ``engine dropped it``: its own replica had been sent the prefix, yet the engine reported less cached (eviction,
  or llama.cpp's host prompt cache, which keeps whole prompts and restores one entry per request);
- ``elsewhere`` (the peer, whose reasons are not logged): another replica held more through finished requests.

Per cause: requests, tokens recomputed (obtainable − cached), and the TTFT those requests took beyond the other
router's on the same requests (ms). Then the placements: sessions moved between turns, and first turns whose
prefix was in flight that joined or left the replica computing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

CAUSES = ("first turns split", "later turn split", "spill on load", "index missed a holder", "engine dropped it",
          "elsewhere")


def obtainable(req: Mapping) -> int:
    """The most of the prompt any replica held when the request was sent (its last token is always computed)."""
    held = max(req.get("other_finished", 0), req.get("own_sent", 0))
    return max(0, min(held, (req.get("prompt_tokens") or 1) - 1))


def believed(decision: Mapping | None) -> tuple[int, int]:
    """(the chosen replica's believed matched tokens, the most another replica was believed to hold)."""
    if not decision or "inputs" not in decision:
        return 0, 0
    chosen = decision.get("backend")
    per = decision["inputs"]["candidates"]
    mine = per.get(chosen, {}).get("matched", 0)
    other = max((c["matched"] for b, c in per.items() if b != chosen), default=0)
    return mine, other


def cause(req: Mapping, decision: Mapping | None) -> str | None:
    """The cause of a request's shortfall (None: it got what the fleet held)."""
    cached = req.get("cached_tokens") or 0
    best = obtainable(req)
    in_flight = min(req.get("other_sent", 0), (req.get("prompt_tokens") or 1) - 1)
    if in_flight > max(best, cached) + 16:
        return "first turns split" if req["turn"] == 0 else "later turn split"
    if cached + 16 >= best:
        return None
    if req.get("own_sent", 0) >= req.get("other_finished", 0) and req.get("own_sent", 0) > cached + 16:
        return "engine dropped it"
    if decision is None:
        return "elsewhere"
    mine, other = believed(decision)
    return "spill on load" if other > mine else "index missed a holder"


def _shortfall(req: Mapping) -> int:
    cached = req.get("cached_tokens") or 0
    held = max(obtainable(req), min(req.get("other_sent", 0), (req.get("prompt_tokens") or 1) - 1))
    return max(0, held - cached)


def placements(requests: Iterable[Mapping]) -> dict[str, int]:
    """Sessions moved between turns; first turns whose prefix was in flight elsewhere that joined or left."""
    last: dict[str, str | None] = {}
    moved = joined = left = 0
    for req in sorted(requests, key=lambda r: r["start_s"]):
        if req["turn"] > 0 and last.get(req["flow"]) not in (None, req["replica"]):
            moved += 1
        last[req["flow"]] = req["replica"]
        if req["turn"] == 0 and req.get("other_sent", 0) > req.get("other_finished", 0) + 16:
            left += 1
        elif req["turn"] == 0 and req.get("own_sent", 0) > (req.get("other_finished", 0) + 16) and \
                (req.get("cached_tokens") or 0) > 16:
            joined += 1
    return {"sessions moved": moved, "first turns that left a prefix in flight": left,
            "first turns that joined one": joined}


def diff_runs(kv: Mapping, peer: Mapping) -> dict:
    """Per cause, for both routers: requests, tokens recomputed, extra TTFT over the other router (ms)."""
    decisions = {d.get("call_id"): d for d in kv.get("decisions", [])}
    k_req = {(r["flow"], r["turn"]): r for r in kv["requests_log"] if r["ok"]}
    p_req = {(r["flow"], r["turn"]): r for r in peer["requests_log"] if r["ok"]}
    table: dict[str, dict[str, dict[str, float]]] = {
        side: {c: {"requests": 0, "tokens": 0, "extra_ms": 0.0} for c in CAUSES} for side in ("kvroute", "peer")}
    for key in k_req.keys() & p_req.keys():
        k, p = k_req[key], p_req[key]
        for side, req, other, decision in (("kvroute", k, p, decisions.get(k["call_id"])),
                                           ("peer", p, k, None)):
            why = cause(req, decision) if side == "kvroute" else cause(req, None)
            if why is None:
                continue
            row = table[side][why]
            row["requests"] += 1
            row["tokens"] += _shortfall(req)
            if req.get("ttft_s") is not None and other.get("ttft_s") is not None:
                row["extra_ms"] += 1000 * (req["ttft_s"] - other["ttft_s"])
    cached = {side: sum(r.get("cached_tokens") or 0 for r in reqs.values())
              for side, reqs in (("kvroute", k_req), ("peer", p_req))}
    return {"causes": table, "cached_tokens": cached,
            "placements": {"kvroute": placements(k_req.values()), "peer": placements(p_req.values())}}


def request_rows(kv: Mapping, peer: Mapping) -> list[str]:
    """One line per request: both routers' replica, cached / prompt tokens, TTFT; kvroute's reason and beliefs."""
    decisions = {d.get("call_id"): d for d in kv.get("decisions", [])}
    p_req = {(r["flow"], r["turn"]): r for r in peer["requests_log"]}
    rows = []
    for k in sorted(kv["requests_log"], key=lambda r: r["start_s"]):
        p = p_req.get((k["flow"], k["turn"]))
        d = decisions.get(k["call_id"])
        beliefs = ""
        if d and "inputs" in d:
            beliefs = " ".join(f"{b}={c['matched']}{'*' if c['computed'] < c['matched'] else ''}/{c['inflight']}"
                               for b, c in d["inputs"]["candidates"].items())
        line = (f"{k['flow']:>9} t{k['turn']} | kvroute {k['replica']} {k['cached_tokens']}/{k['prompt_tokens']} "
                f"{1000 * (k['ttft_s'] or 0):.0f} ms {d.get('reason', '') if d else ''} [{beliefs}] "
                f"cause={cause(k, d)}")
        if p:
            line += (f" | peer {p['replica']} {p['cached_tokens']}/{p['prompt_tokens']} "
                     f"{1000 * (p['ttft_s'] or 0):.0f} ms cause={cause(p, None)}")
        rows.append(line)
    return rows


def ending_rows(kv_runs: list[Mapping]) -> list[str]:
    """One line per kvroute attempt that ended with no answer (a retry's cause: how, backend, verdict, the
    exception's classes), from the decision log's ``ended`` lines."""
    rows = []
    for i, run in enumerate(kv_runs):
        for e in run.get("endings", []):
            rows.append(f"- kvroute repeat {i + 1}: {e.get('call_id')} ended {e.get('how')} on {e.get('backend')}, "
                        f"{e.get('verdict')} (HTTP {e.get('http_status')}): {' <- '.join(e.get('error') or [])}")
    return rows


def render(result: Mapping, peer_key: str, workloads: Iterable[str] | None, show_requests: bool) -> str:
    lines = []
    for name, w in result["workloads"].items():
        if workloads and name not in workloads:
            continue
        kv_runs, peer_runs = w["runs"].get("kvroute", []), w["runs"].get(peer_key, [])
        if not kv_runs or not peer_runs:
            lines.append(f"## {name}: no kvroute or {peer_key} run")
            continue
        diffs = [diff_runs(k, p) for k, p in zip(kv_runs, peer_runs, strict=False)]
        lines += ["", f"## {name} — kvroute vs {peer_key}, {len(diffs)} repeat(s), summed over repeats", "",
                  "| cause | kvroute requests | kvroute tokens recomputed | kvroute extra TTFT | peer requests | "
                  "peer tokens recomputed | peer extra TTFT |", "|---|---|---|---|---|---|---|"]
        for c in CAUSES:
            k = [d["causes"]["kvroute"][c] for d in diffs]
            p = [d["causes"]["peer"][c] for d in diffs]
            if not any(r["requests"] for r in k + p):
                continue
            lines.append(f"| {c} | {sum(r['requests'] for r in k)} | {sum(r['tokens'] for r in k):,} | "
                         f"{sum(r['extra_ms'] for r in k):+,.0f} ms | {sum(r['requests'] for r in p)} | "
                         f"{sum(r['tokens'] for r in p):,} | {sum(r['extra_ms'] for r in p):+,.0f} ms |")
        for side in ("kvroute", "peer"):
            agg = defaultdict(int)
            for d in diffs:
                for key, v in d["placements"][side].items():
                    agg[key] += v
            lines.append(f"- {side}: " + ", ".join(f"{k} {v}" for k, v in agg.items())
                         + f"; cached tokens {sum(d['cached_tokens'][side] for d in diffs):,}")
        lines += ending_rows(kv_runs)
        if show_requests:
            for i, (k, p) in enumerate(zip(kv_runs, peer_runs, strict=False)):
                lines += ["", f"### {name} repeat {i + 1}", "", *request_rows(k, p)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a bench/peers.py --json result")
    ap.add_argument("--peer", default="smg-ca", help="the rival to compare kvroute with (default smg-ca)")
    ap.add_argument("--workload", action="append", help="only these workloads (repeatable)")
    ap.add_argument("--requests", action="store_true", help="also print every request of every run")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    if not result.get("fresh_fleet"):
        print("note: not a --fresh-fleet run: the rivals replayed different prompts on different fleet states, "
              "so requests are compared by position only", file=sys.stderr)
    print(render(result, args.peer, args.workload, args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
