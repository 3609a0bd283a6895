"""A bounded load test of the gateway: the real gateway process (``python -m mmcpu.gateway``) in front of two
stand-in engines that answer like vLLM's server (``/health``, ``/v1/models``, ``/metrics``, a transcription that
reads its whole upload, a chat that takes ``CHAT_S``): the gateway, not an engine, is what is measured.

``slow`` + ``fast`` clients, all connected at once:

- ``slow`` slow-loris uploads to the audio engine: headers and the ``model`` field at once, then a byte every
  second; those the gateway admits fill the engine's places and queue, the rest are refused 429. At the end each
  held upload sends the rest of its body, and must be answered;
- ``fast`` clients, each sending a request, reading its answer and resting ``pace_s``: ``chat_clients`` of them
  chat with the vision engine (each admitted, each must be answered 200), the others send transcriptions to the
  audio engine the slow clients fill (the excess: refused, each time measured);
- ``/health`` polled every 100 ms: every answer's time;
- the gateway's peak RSS (VmHWM).

:func:`verdict` lists the bounds a run broke (:data:`BOUNDS`). Run: ``python -m mmcpu_dev.gateway_load`` (500
clients, 200 slow; prints JSON, exits 1 when a bound is broken); ``make bench-gateway``
(:mod:`mmcpu_dev.bench.gateway`) records it; tests call :func:`run` with smaller counts
(tests/test_gateway_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from mmcpu import cpu

AUDIO_MODEL, VISION_MODEL = "load-audio", "load-vision"
CHAT_S = 0.05
KEY = "load-test-key"
# A fast client's rest between requests: 300 of them make 60 requests a second, a load the gateway must take on a
# shared 2-CPU machine with the clients themselves beside it (at 1 s the Python clients alone saturated it).
PACE_S = 5.0
FINISH_S = 60  # how long an answer may take once its request is whole, before it counts as never answered


def stand_in(model: str) -> FastAPI:
    app = FastAPI()
    tokens = {"n": 0}

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 2048}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total {tokens['n']}\n")

    @app.post("/v1/audio/transcriptions")
    async def transcribe(request: Request) -> Response:
        try:
            size = len(await request.body())
        except ClientDisconnect:  # a slow client's upload ended by the gateway (test over, or 408)
            return Response(status_code=499)
        tokens["n"] += 1
        return JSONResponse({"text": f"{size} bytes"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        await request.body()
        await asyncio.sleep(CHAT_S)
        tokens["n"] += 1
        return JSONResponse(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            }
        )

    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _served(command: list[str], port: int, log: Path, what: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """``command`` (a server on 127.0.0.1:``port``, output into ``log``) until its /health answers 200: its pid;
    stopped on exit."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def gateway_process(engines: str, log: Path, **settings: Any) -> Iterator[tuple[str, int]]:
    """The real gateway entry point in its own process on loopback: (url, pid)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMCPU_")} | {
        "MMCPU_HOST": "127.0.0.1",
        "MMCPU_GATEWAY_PORT": str(port),
        "MMCPU_ENGINES": engines,
        "MMCPU_API_KEY": KEY,
        **{f"MMCPU_{k.upper()}": str(v) for k, v in settings.items()},
    }
    with _served([sys.executable, "-m", "mmcpu.gateway"], port, log, "the gateway", env) as pid:
        yield f"http://127.0.0.1:{port}", pid


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _slow_upload(url: str, stop: asyncio.Event, outcome: dict[str, int]) -> None:
    """Headers and the model field at once, then one byte a second of a 1 MiB file until ``stop``; then the rest
    of the body at once, and the answer: an upload the gateway admitted must be answered once it is whole."""
    host, port = url.removeprefix("http://").split(":")
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{AUDIO_MODEL}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    size = 1 << 20
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        outcome["connect_failed"] = outcome.get("connect_failed", 0) + 1
        return
    try:
        writer.write(
            f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(head) + size + len(tail)}\r\n\r\n".encode()
            + head
        )
        await writer.drain()
        answer = asyncio.ensure_future(reader.readline())
        sent = 0
        while not stop.is_set():
            done, _ = await asyncio.wait({answer}, timeout=1.0)
            if done:  # answered before its body was whole: refused (429) or cut (408)
                line = answer.result().decode(errors="replace").split()
                key = line[1] if len(line) > 1 else "closed"
                outcome[key] = outcome.get(key, 0) + 1
                return
            writer.write(b"\0")
            sent += 1
            await writer.drain()
        writer.write(b"\0" * (size - sent) + tail)
        await writer.drain()
        try:
            line = (await asyncio.wait_for(answer, FINISH_S)).decode(errors="replace").split()
            key = f"held, then {line[1] if len(line) > 1 else 'closed'}"
        except TimeoutError:
            key = "held, then no answer"
        outcome[key] = outcome.get(key, 0) + 1
    except OSError:
        outcome["reset"] = outcome.get("reset", 0) + 1
    finally:
        writer.close()


def _summary(times: list[float]) -> dict[str, float]:
    if not times:
        return {"count": 0}
    ordered = sorted(times)
    return {
        "count": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def _count(table: dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


async def _health_group(url: str, start_at: float, stop_at: float) -> dict[str, Any]:
    """``/health`` every 100 ms from ``start_at`` to ``stop_at``: every answer's time."""
    times: list[float] = []
    status: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=FINISH_S) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        while time.time() < stop_at:
            t0 = time.perf_counter()
            try:
                r = await client.get("/health")
                key = str(r.status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            times.append(time.perf_counter() - t0)
            _count(status, key)
            await asyncio.sleep(0.1)
    return {"health": (times, status)}


async def _fast_group(
    url: str, first: int, count: int, fast: int, chat_clients: int, pace_s: float, start_at: float, stop_at: float
) -> dict[str, Any]:
    """Fast clients ``first`` .. ``first + count - 1`` of ``fast``, all connected at once: a request, its answer,
    ``pace_s`` of rest, until ``stop_at``. The first ``chat_clients`` chat with the vision engine (they fit its
    places: each one admitted must be answered); the rest send transcriptions to the audio engine the slow clients
    fill (the excess)."""
    chat_times: list[float] = []
    chat_status: dict[str, int] = {}
    overflow_times: list[float] = []  # the refused ones' (429/503) times: how fast the excess is turned away
    overflow_status: dict[str, int] = {}
    # Each client keeps its connection between requests (an expiry beyond the pace): all connected at once.
    limits = httpx.Limits(max_connections=count + 5, max_keepalive_connections=count + 5, keepalive_expiry=pace_s + 30)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=FINISH_S) as client:

        async def fast_client(i: int) -> None:
            chat = i < chat_clients
            await asyncio.sleep(max(0.0, start_at - time.time()) + pace_s * i / max(fast, 1))  # no thundering start
            while time.time() < stop_at:
                t0 = time.perf_counter()
                try:
                    if chat:
                        r = await client.post(
                            "/v1/chat/completions",
                            json={"model": VISION_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                        )
                    else:
                        r = await client.post(
                            "/v1/audio/transcriptions",
                            data={"model": AUDIO_MODEL},
                            files={"file": ("a.wav", b"\0" * 4096, "audio/wav")},
                        )
                    key = str(r.status_code)
                    if r.status_code == 429:
                        assert r.headers.get("retry-after") and r.json()["error"]["code"] == "engine_overloaded"
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                elapsed = time.perf_counter() - t0
                if chat:
                    chat_times.append(elapsed)
                    _count(chat_status, key)
                else:
                    _count(overflow_status, key)
                    if key in ("429", "503"):
                        overflow_times.append(elapsed)
                await asyncio.sleep(pace_s)

        await asyncio.gather(*(fast_client(i) for i in range(first, first + count)))
    return {"other_engine_chats": (chat_times, chat_status), "overflow": (overflow_times, overflow_status)}


async def _slow_group(url: str, slow: int, start_at: float, release_at: float) -> dict[str, Any]:
    outcome: dict[str, int] = {}
    await asyncio.sleep(max(0.0, start_at - time.time()))
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(_slow_upload(url, stop, outcome)) for _ in range(slow)]
    await asyncio.sleep(max(0.0, release_at - time.time()))
    stop.set()  # the held uploads complete now, and each must be answered
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"slow_clients": outcome}


def _group(kind: str, cpus: list[int], *args: Any) -> dict[str, Any]:
    """One client process's work (run in a spawned process, pinned to ``cpus``)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    groups = {"health": _health_group, "fast": _fast_group, "slow": _slow_group}
    return asyncio.run(groups[kind](*args))


FAST_PER_PROCESS = 150  # fast clients per client process: one Python process is far from busy at 150 / pace_s req/s


def _load(
    url: str, slow: int, fast: int, chat_clients: int, seconds: float, pace_s: float, cpus: list[int]
) -> dict[str, Any]:
    """The clients, in processes of their own (the slow uploads; the fast clients, in groups; the /health poll),
    pinned to ``cpus``: one Python process holding every client measured its own event loop's delays, not the
    gateway's. Every process starts its clients at the same wall-clock time, once all have started."""
    start_at = time.time() + 5  # spawned processes import httpx and FastAPI first
    stop_at = start_at + 2 + max(seconds - 2, 1)
    jobs: list[tuple[Any, ...]] = [("slow", cpus, url, slow, start_at, stop_at + 1)]
    jobs.append(("health", cpus, url, start_at + 2, stop_at))  # every slow client connected and holding (or refused)
    for first in range(0, fast, FAST_PER_PROCESS):
        count = min(FAST_PER_PROCESS, fast - first)
        jobs.append(("fast", cpus, url, first, count, fast, chat_clients, pace_s, start_at + 2, stop_at))
    merged: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=len(jobs), mp_context=context) as pool:
        for part in [f.result() for f in [pool.submit(_group, *job) for job in jobs]]:
            for name, value in part.items():
                if name == "slow_clients":
                    merged[name] = value
                    continue
                times, status = merged.setdefault(name, ([], {}))
                times.extend(value[0])
                for key, n in value[1].items():
                    status[key] = status.get(key, 0) + n
    return {
        "slow_clients": merged["slow_clients"],
        **{
            name: {**_summary(merged.get(name, ([], {}))[0]), "status": merged.get(name, ([], {}))[1]}
            for name in ("health", "overflow", "other_engine_chats")
        },
    }


# A refusal as the gateway's own log line records it (mmcpu/gateway/middleware.py): its time from the request's
# arrival to the answer's end, with no client in it.
_REFUSAL = re.compile(r" POST /v1/audio/transcriptions (429|503) ([0-9.]+)ms ")


def gateway_refusals(log: Path) -> dict[str, float]:
    """The refused transcriptions' times as the gateway logged them."""
    return _summary([float(m.group(2)) / 1000 for m in map(_REFUSAL.search, log.read_text().splitlines()) if m])


# The bounds a run must keep (docs/gateway.md; issue "Safe to expose"). The RSS bound is about 3x what the full-size
# run peaks at: a leak per request or per connection grows past it, normal allocator slack does not.
BOUNDS = {"health_max_ms": 1000.0, "reject_p99_ms": 100.0, "rss_mib": 300.0}


def verdict(result: dict[str, Any], bounds: dict[str, float] = BOUNDS) -> list[str]:
    """Every bound the run broke, one line each (empty: all kept):

    - ``/health`` answered 200 every time, each within ``health_max_ms``;
    - every admitted request answered: each chat (they fit the vision engine's places) 200, each transcription
      not refused (429/503) answered below 500, each slow upload held open answered once complete, no transport
      error anywhere;
    - the excess refused (429/503) with p99 within ``reject_p99_ms``, and some excess there was;
    - the gateway's peak RSS within ``rss_mib``."""
    broken = []
    health = result["health"]
    if not health.get("count") or set(health["status"]) != {"200"}:
        broken.append(f"/health not always 200: {health['status']}")
    if health.get("max_ms", 0) >= bounds["health_max_ms"]:
        broken.append(f"/health took {health['max_ms']} ms (bound < {bounds['health_max_ms']:g} ms)")
    chats = result["other_engine_chats"]
    if not chats.get("count") or set(chats["status"]) != {"200"}:
        broken.append(f"chats to the other engine not all answered 200: {chats['status']}")
    overflow = result["overflow"]
    unanswered = {k: n for k, n in overflow["status"].items() if not (k.isdigit() and int(k) < 500) and k != "503"}
    if unanswered:
        broken.append(f"transcriptions not answered: {unanswered}")
    if not overflow.get("count"):
        broken.append(f"no request was refused: the load did not reach the admission limit ({overflow['status']})")
    elif overflow["p99_ms"] > bounds["reject_p99_ms"]:
        broken.append(f"excess refused in p99 {overflow['p99_ms']} ms (bound {bounds['reject_p99_ms']:g} ms)")
    held = {k: n for k, n in result["slow_clients"].items() if k.startswith("held")}
    if not held or set(held) != {"held, then 200"}:
        broken.append(f"slow uploads held open were not all answered 200 once complete: {held}")
    other = {k: n for k, n in result["slow_clients"].items() if not k.startswith("held") and k not in ("429", "503")}
    if other:
        broken.append(f"slow uploads neither held nor refused (429/503): {other}")
    if not result["gateway_peak_rss_mib"] <= bounds["rss_mib"]:
        broken.append(f"gateway peak RSS {result['gateway_peak_rss_mib']} MiB (bound {bounds['rss_mib']:g} MiB)")
    return broken


def _pin(pid: int, cpus: list[int]) -> None:
    """Pin every thread of ``pid`` (threads started later inherit it from theirs)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def stand_in_process(model: str, cpus: list[int], log: Path) -> Iterator[str]:
    """A stand-in engine in a process of its own (``python -m mmcpu_dev.gateway_load --stand-in``), pinned to
    ``cpus``: its url."""
    port = _free_port()
    command = [sys.executable, "-m", "mmcpu_dev.gateway_load", "--stand-in", model, "--port", str(port)]
    with _served(command, port, log, f"the stand-in {model}") as pid:
        _pin(pid, cpus)
        yield f"http://127.0.0.1:{port}"


def placement() -> tuple[list[int], list[int]]:
    """(the gateway's CPUs, everyone else's): on two CPUs or more the gateway gets the first alone - it is one
    process with one event loop, so one core is all it can use, as a deployment gives it - and the clients and
    stand-ins the rest, so that they do not delay the gateway and the times measure it. On one CPU, shared."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[:1], cpus[1:]) if len(cpus) >= 2 else (cpus, cpus)


def run(
    slow: int = 200,
    fast: int = 300,
    seconds: float = 15,
    log: Path = Path("gateway-load.log"),
    *,
    chat_clients: int = 20,
    pace_s: float = PACE_S,
    **settings: Any,
) -> dict[str, Any]:
    """The load test: ``slow`` + ``fast`` clients at once for ``seconds``; ``settings`` are gateway settings
    (engine_concurrency=8, engine_queue=32 unless given)."""
    settings = {
        "engine_concurrency": 8,
        "engine_queue": 32,
        "body_timeout_s": seconds + 30,
        "queue_timeout_s": seconds + 30,
    } | settings
    load_before = os.getloadavg()[0]
    gateway_cpus, client_cpus = placement()
    with (
        stand_in_process(AUDIO_MODEL, client_cpus, log.with_name(f"{log.stem}-{AUDIO_MODEL}.log")) as audio,
        stand_in_process(VISION_MODEL, client_cpus, log.with_name(f"{log.stem}-{VISION_MODEL}.log")) as vision,
        gateway_process(f"audio={audio},vision={vision}", log, **settings) as (url, pid),
    ):
        _pin(pid, gateway_cpus)
        result = _load(url, slow, fast, chat_clients, seconds, pace_s, client_cpus)
        result["gateway_peak_rss_mib"] = round(_peak_rss_mib(pid), 1)
    result["overflow"]["gateway_side"] = gateway_refusals(log)
    load_after = os.getloadavg()[0]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu.current().line(),
        "load_before": load_before,
        "load_after": load_after,
        "busy": max(load_before, load_after) > 1.5,
        "clients": slow + fast,
        "slow": slow,
        "fast": fast,
        "chat_clients": chat_clients,
        "pace_s": pace_s,
        "seconds": seconds,
        "placement": {"gateway_cpus": gateway_cpus, "client_cpus": client_cpus},
        "settings": settings,
        **result,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--fast", type=int, default=300)
    parser.add_argument("--chat-clients", type=int, default=20)
    parser.add_argument("--pace-s", type=float, default=PACE_S)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--stand-in", metavar="MODEL", help="serve one stand-in engine (run() starts two)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.stand_in:
        uvicorn.run(stand_in(args.stand_in), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
        return 0
    result = run(args.slow, args.fast, args.seconds, chat_clients=args.chat_clients, pace_s=args.pace_s)
    result["broken"] = verdict(result)
    print(json.dumps(result, indent=2))
    return 1 if result["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
