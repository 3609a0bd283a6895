"""python -m mmcpu_dev.bench gateway (make bench-gateway; make bench runs it last): the gateway's load test at full
size (:mod:`mmcpu_dev.gateway_load`: 500 clients at once, 200 of them slow-loris uploads), its figures with the CPU
into docs/bench/results.json (``gateway_load``) and the generated block of docs/gateway.md. Exits 1 when a bound is
broken (``/health`` >= 1 s or not 200, an admitted request unanswered, the excess refused in p99 > 100 ms, the
gateway's RSS over its bound): the figures are written either way, the broken bounds listed with them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mmcpu.config import REPO_ROOT, get_settings
from mmcpu_dev import gateway_load
from mmcpu_dev.docblock import replace_block

DOC = REPO_ROOT / "docs" / "gateway.md"
BEGIN, END = "<!-- BEGIN gateway-load (make bench-gateway) -->", "<!-- END gateway-load -->"


def render(r: dict[str, Any]) -> str:
    def times(x: dict[str, Any]) -> str:
        return f"median {x['p50_ms']} ms, p99 {x['p99_ms']} ms, max {x['max_ms']} ms" if x.get("count") else "none"

    def statuses(x: dict[str, Any]) -> str:
        return ", ".join(f"{k}: {n}" for k, n in sorted(x.items()))

    def placed(p: dict[str, list[int]] | None) -> str:
        if not p:
            return "The clients, the gateway and the stand-ins share the same CPUs."
        if p["gateway_cpus"] == p["client_cpus"]:
            return f"The clients, the gateway and the stand-ins share CPU {p['gateway_cpus']}."
        return (
            f"The gateway (one process, one event loop) is pinned to CPU {p['gateway_cpus'][0]}; the clients "
            f"(processes of their own: the slow uploads, the fast clients in groups of "
            f"{gateway_load.FAST_PER_PROCESS}, the `/health` poll) and the two stand-in engines to "
            f"CPU {', '.join(map(str, p['client_cpus']))}."
        )

    s = r["settings"]
    b = r["bounds"]
    return "\n".join(
        [
            f"Measured {r['date']} on {r['cpu']}; 1-minute load average before / after: {r['load_before']:.1f} / "
            f"{r['load_after']:.1f}{' (a shared, busy machine: figures disturbed)' if r['busy'] else ''}. "
            f"{r['clients']} clients at once for {r['seconds']:g} s: {r['slow']} slow-loris uploads, "
            f"{r['fast']} clients pacing {r['pace_s']:g} s between requests ({r['chat_clients']} of them chatting "
            f"with the other engine); `MMCPU_ENGINE_CONCURRENCY={s['engine_concurrency']}`, "
            f"`MMCPU_ENGINE_QUEUE={s['engine_queue']}`. {placed(r.get('placement'))} Times are as the clients saw "
            "them; the refusals also as the gateway logged them (arrival to answer, no client in it).",
            "",
            "| What | Result | Bound |",
            "|---|---|---|",
            f"| slow uploads | {statuses(r['slow_clients'])} | each held one answered once complete |",
            f"| transcriptions to the full engine | {statuses(r['overflow']['status'])}; refused in "
            f"{times(r['overflow'])} (as the gateway logged every refusal, the slow uploads' opening burst "
            f"included: {times(r['overflow'].get('gateway_side', {}))}) | "
            f"refused p99 ≤ {b['reject_p99_ms']:g} ms, none unanswered |",
            f"| `/health` (every 100 ms) | {statuses(r['health']['status'])}: {times(r['health'])} | "
            f"each 200 in < {b['health_max_ms']:g} ms |",
            f"| chats to the other engine | {statuses(r['other_engine_chats']['status'])}: "
            f"{times(r['other_engine_chats'])} ({gateway_load.CHAT_S * 1000:g} ms of it the stand-in's own work) | "
            "each answered 200 |",
            f"| gateway peak RSS | {r['gateway_peak_rss_mib']} MiB | ≤ {b['rss_mib']:g} MiB |",
            "",
            "Verdict: " + ("every bound kept." if not r["broken"] else "BROKEN: " + "; ".join(r["broken"]) + "."),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--fast", type=int, default=300)
    parser.add_argument("--chat-clients", type=int, default=20)
    parser.add_argument("--pace-s", type=float, default=gateway_load.PACE_S)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/gateway.md's figures")
    args = parser.parse_args(argv)
    folder = get_settings().cache_dir / "bench-gateway"
    folder.mkdir(parents=True, exist_ok=True)
    result = gateway_load.run(
        args.slow,
        args.fast,
        args.seconds,
        folder / "gateway.log",
        chat_clients=args.chat_clients,
        pace_s=args.pace_s,
    )
    result["bounds"] = gateway_load.BOUNDS
    result["broken"] = gateway_load.verdict(result)
    # Merged into results.json (its other phases' figures untouched; created if no full run wrote it yet).
    path = args.out / "bench" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(path.read_text()) if path.is_file() else {}
    results["gateway_load"] = result
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")  # as run.write does
    table = render(result)
    print(table)
    if not args.no_doc:
        DOC.write_text(replace_block(DOC.read_text(), BEGIN, END, table, "docs/gateway.md"))
    for line in result["broken"]:
        print(f"error: bound broken: {line}", file=sys.stderr)
    return 1 if result["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
