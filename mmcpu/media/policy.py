"""Which media URLs an engine may fetch, and which addresses it may connect to for them.

Closed by default: only ``data:`` URLs, which carry their bytes and make the engine connect nowhere. An http(s) URL
is fetched only when its host is one MMCPU_MEDIA_DOMAINS names (exactly; no wildcard), and then only from public
unicast addresses: loopback, private, link-local (the cloud metadata address), shared/CGNAT, multicast, reserved,
documentation and the IPv6 forms that embed an IPv4 address (mapped, compatible, 6to4, NAT64) are refused, whatever
notation the URL writes them in. The check runs on the addresses the name resolves to, and the connection is made to
exactly those (:class:`PublicResolver`), so a DNS answer that changes between a check and a connect (rebinding)
cannot move it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 ranges that carry an IPv4 address a gateway or the kernel may map back (Python 3.11's is_global calls some of
# them global): IPv4-compatible (deprecated), NAT64 (well-known and local-use), 6to4.
_EMBEDS_IPV4 = [ipaddress.ip_network(n) for n in ("::/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16")]


class Refused(Exception):
    """A URL or an address the policy does not allow. Its text is for logs only: clients get one fixed message."""


def is_public(address: IPAddress) -> bool:
    """Global unicast only (what a fetch for a client may reach)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if any(address in net for net in _EMBEDS_IPV4):
            return False
    return address.is_global and not address.is_multicast


def ip_literal(host: str) -> IPAddress | None:
    """The address when ``host`` is written as a standard IP literal (brackets allowed), else None. Other numeric
    forms (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) are not literals here: they go to the resolver, which turns
    them into the address it will connect to, and that address is checked."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """A host as compared with the allowlist: lower-case ASCII (IDNA), without a trailing dot."""
    raw = URL.build(scheme="http", host=host.strip().strip("[]")).raw_host or ""
    return raw.lower().rstrip(".")


class Policy:
    """The allowlist (MMCPU_MEDIA_DOMAINS, passed to vLLM as ``--allowed-media-domains``) and the URL checks."""

    def __init__(self, domains: Iterable[str] = ()) -> None:
        self.domains = frozenset(normalize_host(d) for d in domains if d and d.strip())

    def check_url(self, url: str | URL) -> URL:
        """The parsed URL when it may be fetched (scheme, listed host, literal address public), else Refused."""
        try:
            parsed = url if isinstance(url, URL) else URL(url)
        except (ValueError, TypeError) as exc:
            raise Refused(f"unparsable URL: {exc}") from None
        if parsed.scheme not in ("http", "https"):
            raise Refused(f"scheme {parsed.scheme!r}")
        host = normalize_host(parsed.raw_host or "")
        if not host:
            raise Refused("no host")
        if host not in self.domains:
            raise Refused(f"host {host!r} not in the media allowlist")
        literal = ip_literal(host)
        if literal is not None and not is_public(literal):
            raise Refused(f"address {literal} is not public")
        return parsed


class PublicResolver(AbstractResolver):
    """aiohttp's threaded resolver (the system's getaddrinfo: /etc/hosts, DNS, and the numeric forms inet_aton
    accepts) that refuses a name if any address it resolves to is not public. aiohttp connects only to the addresses
    a resolver returns, so the address checked is the address connected to."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            address = ipaddress.ip_address(result["host"].split("%")[0])
            if not is_public(address):
                raise Refused(f"{host} resolves to {address}, which is not public")
        if not results:
            raise Refused(f"{host} resolves to nothing")
        return results

    async def close(self) -> None:
        await self._inner.close()
