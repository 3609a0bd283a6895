"""A network of our own for the media-URL policy: public addresses, a DNS server and web servers, all inside a network
namespace made for the run, so that no packet leaves it.

    python -m mmcpu_dev.netlab          # as root: prints one JSON line of results

What a test of the policy needs cannot exist on the host: a listed domain that resolves to a *public* address which
answers (to follow its redirects, read its 5xx, time out on it), a DNS server whose answers change between two
lookups (rebinding), and private and metadata addresses that something listens on (to prove nothing connects to
them). ``unshare --net --mount`` gives a fresh namespace with only a loopback interface and private copies of
/etc/hosts and /etc/resolv.conf; inside, :func:`inside` puts 11.22.33.44 (PUBLIC), 11.22.33.45 (OTHER), 10.0.0.1
and 169.254.169.254 on that loopback, starts a DNS server (dnspython) on 127.0.0.1:53 and web servers on every
address, and loads media through mmcpu's connector exactly as vLLM's API server does
(``MEDIA_CONNECTOR_REGISTRY.load("mmcpu", ...)``). Each scenario's outcome is ``ok``, ``failed`` (the one fixed
text) or ``limit:SETTING``, with its time; the internal servers count the connections they got (must be 0).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PUBLIC, OTHER = "11.22.33.44", "11.22.33.45"  # global unicast, so the policy lets them through: ours only here
INTERNAL = ("127.0.0.1", "::1", "10.0.0.1", "169.254.169.254")  # listening, and must never see a connection
LISTED = [
    "media.test",
    "other.test",
    "internal.test",
    "private.test",
    "metadata.test",
    "mixed.test",
    "rebind.test",
    "v6.test",
    "mapped.test",
    PUBLIC,
]
ZONE: dict[str, list[tuple[str, str]]] = {  # name -> [(type, address)]
    "media.test": [("A", PUBLIC)],
    "other.test": [("A", OTHER)],
    "unlisted.test": [("A", OTHER)],
    "internal.test": [("A", "127.0.0.1")],
    "private.test": [("A", "10.0.0.1")],
    "metadata.test": [("A", "169.254.169.254")],
    "mixed.test": [("A", PUBLIC), ("A", "127.0.0.1")],
    "v6.test": [("AAAA", "::1")],
    "mapped.test": [("AAAA", "::ffff:127.0.0.1")],
}
REBIND = "rebind.test"  # A queries answer PUBLIC, then 127.0.0.1, then PUBLIC... with TTL 0
FETCH_TIMEOUT_S = 2  # VLLM_IMAGE_FETCH_TIMEOUT inside the lab: the slow scenarios end after it
MAX_MEDIA_MB = 1


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


# --- DNS -------------------------------------------------------------------------------------------------------
class Dns:
    """An authoritative answerer for ZONE (and REBIND) on 127.0.0.1:53/udp, counting A queries per name."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))
        self.a_queries: Counter[str] = Counter()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import dns.message
        import dns.rcode
        import dns.rdatatype
        import dns.rrset

        while True:
            data, peer = self.sock.recvfrom(4096)
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)
            question = query.question[0]
            name = question.name.to_text().rstrip(".").lower()
            kind = dns.rdatatype.to_text(question.rdtype)
            if kind == "A":
                self.a_queries[name] += 1
            if name == REBIND:
                records = [("A", PUBLIC if self.a_queries[name] % 2 else "127.0.0.1")]
            else:
                records = ZONE.get(name)
            if records is None:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            for rtype, address in records or []:
                if rtype == kind:
                    reply.answer.append(dns.rrset.from_text(question.name, 0, "IN", rtype, address))
            self.sock.sendto(reply.to_wire(), peer)


# --- web servers ---------------------------------------------------------------------------------------------
HITS: Counter[str] = Counter()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    png = b""
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:
        host = self.server.server_address[0]
        HITS[host] += 1
        if host in INTERNAL:
            self._send(200, {"Content-Type": "application/json"}, b'{"object": "list", "data": []}')
            return
        path = self.path
        if path == "/slow":
            time.sleep(FETCH_TIMEOUT_S * 3)
        if path == "/drip":  # headers at once, then a byte a second: only a deadline on the whole fetch ends it
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(1)
            return
        if path == "/chunked-big":  # no Content-Length: the cap applies while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                for _ in range(MAX_MEDIA_MB * 16 + 32):
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            return
        status, headers, body = self.routes.get(path, (404, {}, b"not found"))
        self._send(status, headers, body)

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def _routes(internal_port: int) -> dict[str, tuple[int, dict[str, str], bytes]]:
    from mmcpu_dev import payloads

    png = _png()
    redirect = lambda to: (302, {"Location": to}, b"")  # noqa: E731
    return {
        "/ok.png": (200, {"Content-Type": "image/png"}, png),
        "/bomb.png": (200, {"Content-Type": "image/png"}, payloads.png_declaring(30000, 30000)),
        "/gif-frames.gif": (200, {"Content-Type": "image/gif"}, payloads.gif_declaring(2000, 2000, 40)),
        "/json": (200, {"Content-Type": "application/json"}, b'{"not": "an image"}'),
        "/404": (404, {}, b"gone"),
        "/500": (500, {}, b"internal error with a stack trace"),
        "/503": (503, {"Retry-After": "1"}, b"busy"),
        "/big": (200, {"Content-Length": str(MAX_MEDIA_MB * 2**20 * 20)}, png),
        "/gzip": (200, {"Content-Encoding": "gzip"}, gzip.compress(b"\0" * 2**22)),
        "/redirect-listed": redirect("http://other.test/ok.png"),
        "/redirect-relative": redirect("/ok.png"),
        "/redirect-unlisted": redirect("http://unlisted.test/ok.png"),
        "/redirect-internal-name": redirect(f"http://internal.test:{internal_port}/"),
        "/redirect-loopback": redirect(f"http://127.0.0.1:{internal_port}/"),
        "/redirect-decimal": redirect(f"http://2130706433:{internal_port}/"),
        "/redirect-private": redirect("http://10.0.0.1/"),
        "/redirect-metadata": redirect("http://169.254.169.254/latest/meta-data/"),
        "/redirect-mapped": redirect(f"http://[::ffff:127.0.0.1]:{internal_port}/"),
        "/redirect-data": redirect("data:image/png;base64," + __import__("base64").b64encode(png).decode()),
        "/redirect-file": redirect("file:///etc/passwd"),
        "/redirect-loop": redirect("/redirect-loop"),
        "/redirect-no-location": (302, {}, b""),
    }


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _serve(address: str, port: int) -> int:
    server = (_Server6 if ":" in address else ThreadingHTTPServer)((address, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


# --- scenarios -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    url: str
    expect: str  # "ok" | "failed" | "limit:MMCPU_..."


def scenarios(internal_port: int) -> list[Scenario]:
    s = Scenario
    out = [
        s("listed-public-ok", "http://media.test/ok.png", "ok"),
        s("listed-ip-literal-ok", f"http://{PUBLIC}/ok.png", "ok"),
        s("redirect-to-listed-ok", "http://media.test/redirect-listed", "ok"),
        s("redirect-relative-ok", "http://media.test/redirect-relative", "ok"),
        s("unlisted-public", "http://unlisted.test/ok.png", "failed"),
        s("unlisted-public-literal", f"http://{OTHER}/ok.png", "failed"),
        s("listed-resolves-loopback", f"http://internal.test:{internal_port}/", "failed"),
        s("listed-resolves-private", "http://private.test/", "failed"),
        s("listed-resolves-metadata", "http://metadata.test/latest/meta-data/", "failed"),
        s("listed-resolves-public-and-loopback", "http://mixed.test/ok.png", "failed"),
        s("listed-resolves-ipv6-loopback", f"http://v6.test:{internal_port}/", "failed"),
        s("listed-resolves-ipv4-mapped", f"http://mapped.test:{internal_port}/", "failed"),
        s("listed-nxdomain", "http://nothing.media.test/ok.png", "failed"),
        s("http-404", "http://media.test/404", "failed"),
        s("http-500", "http://media.test/500", "failed"),
        s("http-503", "http://media.test/503", "failed"),
        s("not-an-image", "http://media.test/json", "failed"),
        s("slow-headers", "http://media.test/slow", "failed"),
        s("slow-body-drip", "http://media.test/drip", "failed"),
        s("gzip-encoded", "http://media.test/gzip", "failed"),
        s("content-length-over-cap", "http://media.test/big", "limit:MMCPU_MAX_MEDIA_MB"),
        s("chunked-over-cap", "http://media.test/chunked-big", "limit:MMCPU_MAX_MEDIA_MB"),
        s("declared-bomb", "http://media.test/bomb.png", "limit:MMCPU_MAX_IMAGE_PIXELS"),
        s("gif-frames-bomb", "http://media.test/gif-frames.gif", "limit:MMCPU_MAX_IMAGE_PIXELS"),
        s("redirect-loop", "http://media.test/redirect-loop", "failed"),
        s("redirect-without-location", "http://media.test/redirect-no-location", "failed"),
    ]
    for target in ("unlisted", "internal-name", "loopback", "decimal", "private", "metadata", "mapped", "data", "file"):
        out.append(s(f"redirect-to-{target}", f"http://media.test/redirect-{target}", "failed"))
    return out


async def _run(scenario: Scenario, connector: object) -> tuple[str, float, str]:
    from vllm.exceptions import VLLMValidationError

    from mmcpu.media import connector as media
    from mmcpu.media import limits

    t0 = time.perf_counter()
    try:
        await connector.fetch_image_async(scenario.url)  # type: ignore[attr-defined]
        outcome, message = "ok", ""
    except limits.OverLimit as exc:
        setting = next((w.strip("().,=") for w in str(exc).split() if w.strip("(").startswith("MMCPU_")), "?")
        outcome, message = f"limit:{setting.split('=')[0]}", str(exc)
    except VLLMValidationError as exc:
        message = str(exc)
        outcome = "failed" if message.startswith(media.FETCH_FAILED) else f"other:{message}"
    return outcome, time.perf_counter() - t0, message


def inside() -> dict[str, object]:
    """Runs in the fresh namespace (as root): set the network up, serve, and load every scenario's URL."""
    for address in (PUBLIC, OTHER, "10.0.0.1", "169.254.169.254"):
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    etc = tempfile.mkdtemp(prefix="netlab-")
    for name, text in {
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "resolv.conf": "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
    }.items():
        path = os.path.join(etc, name)
        with open(path, "w") as f:
            f.write(text)
        subprocess.run(["mount", "--bind", path, f"/etc/{name}"], check=True)
    dns_server = Dns()
    internal_port = _serve("127.0.0.1", 0)
    _serve("::1", internal_port)
    for address in ("10.0.0.1", "169.254.169.254"):
        _serve(address, 80)
    _Handler.routes = _routes(internal_port)
    for address in (PUBLIC, OTHER):
        _serve(address, 80)

    os.environ.update(
        MMCPU_MAX_MEDIA_MB=str(MAX_MEDIA_MB),
        MMCPU_MAX_IMAGE_PIXELS="12000000",
        VLLM_IMAGE_FETCH_TIMEOUT=str(FETCH_TIMEOUT_S),
    )
    from mmcpu.plugin import register

    register()
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

    connector = MEDIA_CONNECTOR_REGISTRY.load(
        "mmcpu", media_io_kwargs=None, allowed_local_media_path="", allowed_media_domains=LISTED
    )

    async def run_all() -> dict[str, object]:
        results = {}
        for scenario in scenarios(internal_port):
            outcome, seconds, message = await _run(scenario, connector)
            results[scenario.name] = {
                "expect": scenario.expect,
                "outcome": outcome,
                "seconds": round(seconds, 3),
                "message": message[:300],
            }
        # Rebinding: the DNS answer flips between a public address and loopback on every lookup, TTL 0. Each fetch
        # must look the name up once and connect to what that lookup gave: some fetches succeed (public), some
        # are refused (loopback), and loopback never sees a connection.
        rebind = []
        for _ in range(6):
            before = dns_server.a_queries[REBIND]
            outcome, _s, _m = await _run(Scenario("rebind", f"http://{REBIND}/ok.png", ""), connector)
            rebind.append({"outcome": outcome, "lookups": dns_server.a_queries[REBIND] - before})
        results["rebinding"] = rebind
        return results

    results = asyncio.run(run_all())
    return {
        "scenarios": results,
        "internal_hits": {a: HITS[a] for a in INTERNAL},
        "public_hits": {a: HITS[a] for a in (PUBLIC, OTHER)},
    }


def run(python: str = sys.executable, timeout_s: float = 300) -> dict[str, object]:
    """Run :func:`inside` in a new network and mount namespace; its JSON result. Needs root (CAP_SYS_ADMIN) and
    iproute2's ``ip``."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found (util-linux / iproute2)")
    cmd = ["unshare", "--net", "--mount", "--propagation", "private", python, "-m", "mmcpu_dev.netlab"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"netlab failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(inside()), flush=True)
