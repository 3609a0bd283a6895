"""mmcpu/media without an engine: the address and URL policy, the size limits read from headers, and the connector
itself (registered through the plugin, as vLLM's API server loads it) against real sockets on loopback.

The engine-level proofs (the same answers over HTTP, through the gateway) are in tests/test_hard_inputs.py; the
fetches that need a public address, a DNS server and redirects are in tests/test_media_netns.py."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import subprocess
import sys
import time

import pytest
import vllm.multimodal.media.connector as vllm_connector
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

from mmcpu.media import connector, limits, policy
from mmcpu.plugin import add_media_connector
from mmcpu_dev import payloads
from mmcpu_dev.servers import closed_port, counting_http_server

# What the plugin's register() does once vLLM has imported its connector module in the API server (without leaving
# register()'s import hooks in this test process: tests/test_plugin.py checks those).
add_media_connector(vllm_connector)

LIMIT = 16 * 2**20  # pixels, for the header checks


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.0.9",
        "0.0.0.0",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "100.64.0.1",
        "169.254.169.254",
        "192.0.0.1",
        "192.0.2.1",
        "198.18.0.1",
        "224.0.0.1",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "::",
        "::1",
        "fe80::1",
        "fc00::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "::127.0.0.1",
        "64:ff9b::7f00:1",
        "64:ff9b:1::a00:1",
        "2002:7f00:1::",
        "2001::1",
        "2001:db8::1",
    ],
)
def test_not_public(address):
    """Loopback, private, CGNAT, link-local/metadata, documentation, multicast, reserved, and the IPv6 forms that
    carry an IPv4 address (some of which Python 3.11 calls global)."""
    assert not policy.is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.216.34", "11.22.33.44", "2606:4700::1111", "::ffff:93.184.216.34"])
def test_public(address):
    assert policy.is_public(ipaddress.ip_address(address))


def test_policy_urls():
    closed = policy.Policy()
    for url in ["http://example.com/a.png", "https://127.0.0.1/", "file:///etc/passwd", "ftp://example.com/x"]:
        with pytest.raises(policy.Refused):
            closed.check_url(url)
    listed = policy.Policy(["Images.Example.com.", "127.0.0.1", "[::1]", "bücher.example"])
    assert listed.check_url("https://images.example.com/a.png").host == "images.example.com"
    assert listed.check_url("http://IMAGES.EXAMPLE.COM./a.png")  # case and a trailing dot do not matter
    assert listed.check_url("http://xn--bcher-kva.example/a.png")  # IDNA: one spelling of one name
    refused = [
        "http://127.0.0.1/x",  # listed, but loopback
        "http://[::1]/x",
        "http://images.example.com@evil.example/x",  # userinfo: the host is evil.example
        "http://evil.example/#@images.example.com",
        "http://images.example.com.evil.example/x",  # a suffix is another host
        "http://sub.images.example.com/x",  # no wildcard
        "javascript:alert(1)",
        "http:///x",
    ]
    for url in refused:
        with pytest.raises(policy.Refused):
            listed.check_url(url)


def test_resolver_refuses_numeric_forms_and_localhost():
    """Names that are not IP literals but resolve to loopback (decimal, octal, hex, short forms, localhost): the
    resolver sees the address the system's getaddrinfo makes of them, and refuses it."""

    async def resolve(host):
        resolver = policy.PublicResolver()
        try:
            return await resolver.resolve(host, 80, socket.AF_UNSPEC)
        finally:
            await resolver.close()

    for host in ["localhost", "2130706433", "0177.0.0.1", "0x7f.1", "0x7f000001", "127.1", "0"]:
        with pytest.raises(policy.Refused):
            asyncio.run(resolve(host))


# --- limits before decoding --------------------------------------------------------------------------------
HEADER_BOMBS = {
    "png-30000": payloads.png_declaring(30000, 30000),
    "jpeg-65000": payloads.jpeg_declaring(65000, 65000),
    "webp-16000": payloads.webp_declaring(16000, 16000),
    "webp-40-frames": payloads.webp_declaring(1000, 1000, 40),
    "gif-65535": payloads.gif_declaring(65535, 65535, 1),
    "gif-40-frames": payloads.gif_declaring(2000, 2000, 40),
    "apng-1M-frames": payloads.apng_declaring(100, 100, 1_000_000),
}


@pytest.mark.parametrize("name", list(HEADER_BOMBS))
def test_header_bombs_refused(name):
    with pytest.raises(limits.OverLimit, match="MMCPU_MAX_IMAGE_PIXELS") as info:
        limits.check_image(HEADER_BOMBS[name], LIMIT)
    assert info.value.parameter == "image_url"


def test_frames_count():
    """The same canvas passes with one frame and is refused with forty: frames are pixels too."""
    assert limits.check_image(payloads.webp_declaring(1000, 1000, 1), LIMIT) == (1000, 1000, 1)
    assert limits.check_image(payloads.gif_declaring(1000, 1000, 3), LIMIT) == (1000, 1000, 3)
    assert limits.check_image(payloads.apng_declaring(64, 64, 2), LIMIT) == (64, 64, 2)
    with pytest.raises(limits.OverLimit, match="x 40 frames"):
        limits.check_image(payloads.gif_declaring(1000, 1000, 40), LIMIT)


def test_other_formats_refused():
    """Only OpenAI's image formats are decoded; PIL's others (BMP, TIFF, PSD, FITS, ...) are refused unread."""
    import io

    from PIL import Image

    for fmt in ("BMP", "TIFF", "ICO", "TGA"):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16)).save(buf, format=fmt)
        with pytest.raises(VLLMValidationError, match="could not be decoded"):
            limits.check_image(buf.getvalue(), LIMIT)


PEAK_PROBE = """
import json, sys
from mmcpu_dev import payloads
from mmcpu.plugin import register
register()
from mmcpu.media import limits
bombs = [payloads.png_declaring(30000, 30000), payloads.png_bomb(13000), payloads.jpeg_declaring(65000, 65000),
         payloads.webp_declaring(16000, 16000), payloads.webp_declaring(13000, 13000, 3),
         payloads.gif_declaring(65535, 65535, 1), payloads.apng_declaring(13000, 13000, 2)]
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
open("/proc/self/clear_refs", "w").write("5")
before = hwm()
refused = 0
for data in bombs:
    try:
        limits.check_image(data, 16 * 2**20)
    except limits.OverLimit:
        refused += 1
print(json.dumps({"refused": refused, "peak_growth": hwm() - before}))
"""


def test_refused_before_any_large_allocation():
    """Bombs of 169 Mpx to 4.3 Gpx (one real 13000x13000 PNG among them) are refused with the process's peak RSS
    growing by less than 8 MiB: nothing was decoded (decoded, the smallest would take ~480 MiB)."""
    result = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["refused"] == 7
    assert out["peak_growth"] < 8 * 2**20, out


# --- the connector, as vLLM builds it ----------------------------------------------------------------------
@pytest.fixture()
def listening():
    """An open port on loopback that answers every GET, counting them (an internal service)."""
    with counting_http_server() as server:
        yield server


def _load(conn, url: str, *, async_: bool = True):
    if async_:
        return asyncio.run(conn.fetch_image_async(url))
    return conn.fetch_image(url)


def test_registered_and_built_like_vllm():
    conn = MEDIA_CONNECTOR_REGISTRY.load(
        connector.NAME, media_io_kwargs=None, allowed_local_media_path="", allowed_media_domains=["localhost"]
    )
    assert isinstance(conn, connector.PolicyMediaConnector)
    image = _load(conn, payloads.image_data_url(payloads.test_image(3)))
    assert image.size == (96, 96)


def _listed_hosts(port: int) -> list[str]:
    return [
        f"http://{host}:{port}/v1/models"
        for host in (
            "localhost",
            "127.0.0.1",
            "2130706433",
            "0177.0.0.1",
            "0x7f.1",
            "127.1",
            "[::ffff:127.0.0.1]",
            "[::1]",
            "0.0.0.0",
        )
    ]


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_internal_urls_refused_without_connecting(listening, async_):
    """Every spelling of loopback, each LISTED in the allowlist: the same 400 and fixed text for the open port and
    a closed one, and the open one never sees a connection."""
    open_port, shut_port = listening.server_address[1], closed_port()
    domains = [
        "localhost",
        "127.0.0.1",
        "2130706433",
        "0177.0.0.1",
        "0x7f.1",
        "127.1",
        "::ffff:127.0.0.1",
        "::1",
        "0.0.0.0",
    ]
    conn = MEDIA_CONNECTOR_REGISTRY.load(connector.NAME, allowed_media_domains=domains)
    answers = set()
    for url in (
        _listed_hosts(open_port)
        + _listed_hosts(shut_port)
        + ["http://unlisted.example/x.png", "file:///etc/passwd", "ftp://x/y"]
    ):
        with pytest.raises(VLLMValidationError) as info:
            _load(conn, url, async_=async_)
        answers.add((str(info.value), info.value.parameter))
    assert answers == {(f"{connector.FETCH_FAILED} (parameter=image_url)", "image_url")}
    assert listening.hits == 0


def test_open_and_closed_ports_take_the_same_time(listening):
    """No timing tell: refusals are decided before any connection, so open and closed ports answer alike (both
    well under 50 ms; the medians within 5 ms of each other)."""
    conn = MEDIA_CONNECTOR_REGISTRY.load(connector.NAME, allowed_media_domains=["127.0.0.1", "localhost"])

    def median_ms(url: str) -> float:
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            with pytest.raises(VLLMValidationError):
                _load(conn, url)
            times.append((time.perf_counter() - t0) * 1000)
        return sorted(times)[len(times) // 2]

    for host in ("127.0.0.1", "localhost"):
        opened = median_ms(f"http://{host}:{listening.server_address[1]}/")
        closed = median_ms(f"http://{host}:{closed_port()}/")
        assert opened < 50 and closed < 50 and abs(opened - closed) < 5, (host, opened, closed)
    assert listening.hits == 0


def test_data_url_size_checked_before_decoding():
    """A data: URL's payload over MMCPU_MAX_MEDIA_MB is refused from its length alone (invalid base64 throughout:
    were it decoded first, the answer would be the base64 error)."""
    conn = MEDIA_CONNECTOR_REGISTRY.load(connector.NAME)
    payload = "@" * (conn.max_bytes * 4 // 3 + 8)
    with pytest.raises(limits.OverLimit, match="MMCPU_MAX_MEDIA_MB"):
        _load(conn, f"data:image/png;base64,{payload}")
    with pytest.raises(VLLMValidationError, match="not valid base64"):
        _load(conn, "data:image/png;base64,@@@@")
    with pytest.raises(VLLMValidationError, match="base64-encoded"):
        _load(conn, "data:image/png,rawbytes")
    with pytest.raises(VLLMValidationError, match="could not be decoded"):
        _load(conn, payloads.image_data_url(b"just text", mime="text/plain"))
