"""A bounded load test of the gateway: the real gateway process (``python -m mmcpu.gateway``) in front of two
stand-in engines that answer like vLLM's server (``/health``, ``/v1/models``, ``/metrics``, a transcription that
reads its whole upload, a chat that takes ``CHAT_S``).

While ``slow`` clients hold uploads open to the audio engine (headers and the ``model`` field at once, then a byte
every second), it measures:

- ``/health`` (polled every 100 ms): every answer's time;
- ``overflow`` more transcriptions to the same audio engine: each one's status and time (429 expected: its places
  and queue are held by the slow clients);
- chats to the other engine, one after another: served, and how fast;
- the gateway's peak RSS (VmHWM).

Run: ``python -m mmcpu_dev.gateway_load --slow 200 --overflow 300 --seconds 15`` (prints JSON); tests call
:func:`run` with smaller counts (tests/test_gateway_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from mmcpu_dev.servers import ServedApp

AUDIO_MODEL, VISION_MODEL = "load-audio", "load-vision"
CHAT_S = 0.05
KEY = "load-test-key"


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
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mmcpu.gateway"], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _slow_upload(url: str, stop: asyncio.Event, outcome: dict[str, int]) -> None:
    """Headers and the model field at once, then one byte a second of a 1 MiB file until ``stop``."""
    host, port = url.removeprefix("http://").split(":")
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{AUDIO_MODEL}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    total = len(head) + (1 << 20)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        outcome["connect_failed"] = outcome.get("connect_failed", 0) + 1
        return
    try:
        writer.write(
            f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {total}\r\n\r\n".encode()
            + head
        )
        await writer.drain()
        answer = asyncio.ensure_future(reader.readline())
        while not stop.is_set():
            done, _ = await asyncio.wait({answer}, timeout=1.0)
            if done:
                line = answer.result().decode(errors="replace").split()
                key = line[1] if len(line) > 1 else "closed"
                outcome[key] = outcome.get(key, 0) + 1
                return
            writer.write(b"\0")
            await writer.drain()
        answer.cancel()
        outcome["held"] = outcome.get("held", 0) + 1
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


async def _load(url: str, slow: int, overflow: int, seconds: float) -> dict[str, Any]:
    stop = asyncio.Event()
    slow_outcome: dict[str, int] = {}
    limits = httpx.Limits(max_connections=overflow + 20)
    headers = {"Authorization": f"Bearer {KEY}"}
    health_times: list[float] = []
    health_status: dict[str, int] = {}
    chat_times: list[float] = []
    chat_status: dict[str, int] = {}
    overflow_times: list[float] = []
    overflow_status: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:
        slow_tasks = [asyncio.ensure_future(_slow_upload(url, stop, slow_outcome)) for _ in range(slow)]
        await asyncio.sleep(2)  # every slow client connected and holding (or refused)

        async def poll_health() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await client.get("/health")
                health_times.append(time.perf_counter() - t0)
                health_status[str(r.status_code)] = health_status.get(str(r.status_code), 0) + 1
                await asyncio.sleep(0.1)

        async def chats() -> None:
            body = {"model": VISION_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                chat_times.append(time.perf_counter() - t0)
                chat_status[str(r.status_code)] = chat_status.get(str(r.status_code), 0) + 1

        async def one_overflow(delay: float) -> None:
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            r = await client.post(
                "/v1/audio/transcriptions",
                data={"model": AUDIO_MODEL},
                files={"file": ("a.wav", b"\0" * 4096, "audio/wav")},
            )
            overflow_times.append(time.perf_counter() - t0)
            overflow_status[str(r.status_code)] = overflow_status.get(str(r.status_code), 0) + 1
            if r.status_code == 429:
                assert r.headers.get("retry-after") and r.json()["error"]["code"] == "engine_overloaded"

        background = [asyncio.ensure_future(poll_health()), asyncio.ensure_future(chats())]
        spread = max(seconds - 3, 1)
        await asyncio.gather(*(one_overflow(spread * i / max(overflow, 1)) for i in range(overflow)))
        await asyncio.sleep(max(0.0, seconds - 2 - spread))
        stop.set()
        await asyncio.gather(*background, *slow_tasks, return_exceptions=True)
    return {
        "slow_clients": slow_outcome,
        "health": {**_summary(health_times), "status": health_status},
        "overflow": {**_summary(overflow_times), "status": overflow_status},
        "other_engine_chats": {**_summary(chat_times), "status": chat_status},
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return f"unknown CPU, {os.cpu_count()} CPUs"


def run(
    slow: int = 200, overflow: int = 300, seconds: float = 15, log: Path = Path("gateway-load.log"), **settings: Any
) -> dict[str, Any]:
    """The load test; ``settings`` are gateway settings (engine_concurrency=8, engine_queue=32 unless given)."""
    settings = {
        "engine_concurrency": 8,
        "engine_queue": 32,
        "body_timeout_s": seconds + 30,
        "queue_timeout_s": seconds + 30,
    } | settings
    audio, vision = ServedApp(stand_in(AUDIO_MODEL)), ServedApp(stand_in(VISION_MODEL))
    try:
        with gateway_process(f"audio={audio.url},vision={vision.url}", log, **settings) as (url, pid):
            result = asyncio.run(_load(url, slow, overflow, seconds))
            result["gateway_peak_rss_mib"] = round(_peak_rss_mib(pid), 1)
    finally:
        audio.stop()
        vision.stop()
    return {
        "cpu": cpu_name(),
        "load_before": os.getloadavg()[0],
        "slow": slow,
        "overflow_requests": overflow,
        "seconds": seconds,
        "settings": settings,
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--overflow", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=15)
    args = parser.parse_args()
    print(json.dumps(run(args.slow, args.overflow, args.seconds), indent=2))


if __name__ == "__main__":
    main()
