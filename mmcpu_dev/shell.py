"""What the host scripts (scripts/docker-e2e: `make up`, `make down`, the image builds) ask Python for, so the shell
does not restate facts the Python side owns:

    served-name MODEL            the name clients address MODEL by (mmcpu.names.served_name, the launcher's rule)
    free-port                    a free loopback port
    human BYTES                  bytes as the e2e figures print them (1.50KiB, 2.41GiB)
    gateway-status URL           the gateway's readiness from its /health: ok | degraded | unavailable, then
                                 NAME:up|down per engine; nothing while it does not answer
    check-port HOST PORT         exit 1 with one line saying what to do when HOST:PORT cannot be listened on
    check-memory MIN_GIB         the same when less than MIN_GIB of memory is available (/proc/meminfo)
    check-disk PATH MIN_GIB      the same when the filesystem of PATH has less than MIN_GIB free

Standard library only, this module and everything it imports (tests/test_host_python.py): `make up` needs no venv
and runs it with the host's python3 in isolated mode without site-packages (``python3 -I -S``), so a third-party
import here fails on every host, not only where the package happens to be missing.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import socket
import sys
import urllib.error
import urllib.request

from mmcpu.names import served_name

GIB = 2**30


def human(n: float) -> str:
    """Bytes in binary units with two decimals (numfmt --to=iec-i --suffix=B --format=%.2f), bytes as a whole."""
    for unit in ("", "Ki", "Mi", "Gi"):
        if n < 1024 or unit == "Gi":
            return f"{n:.2f}{unit}B" if unit else f"{n:.0f}B"
        n /= 1024
    raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_status(base_url: str, timeout_s: float = 2.0) -> str:
    """The gateway's readiness from its /health: its "status" (HTTP 200: ok or degraded; 503: unavailable), then
    each engine as NAME:up or NAME:down, e.g. ``degraded audio:down vision:up``; "" without an answer."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as error:  # 503 still carries the status
        body = error.read()
    except (OSError, ValueError):
        return ""
    try:
        health = json.loads(body)
        status, engines = health["status"], health.get("engines") or {}
        return " ".join([str(status)] + [f"{name}:{'up' if e.get('up') else 'down'}" for name, e in engines.items()])
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def port_problem(host: str, port: int) -> str | None:
    """Why HOST:PORT cannot be published, or None. SO_REUSEADDR as servers set it, so a socket of a past connection
    (TIME_WAIT) does not count; a listener on the port, on this address or on all of them, does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                other = f"{host}:{free_port()}" if host not in ("0.0.0.0", "::") else str(free_port())
                return (
                    f"port {port} on {host} is in use by another program: stop it, or publish the gateway on "
                    f"another port, e.g. MMCPU_PUBLISH={other} make up"
                )
            if error.errno == errno.EADDRNOTAVAIL:
                return (
                    f"{host} is not an address of this host: set MMCPU_PUBLISH=127.0.0.1:{port} "
                    "(or one of its addresses)"
                )
            if error.errno == errno.EACCES:
                return None  # a privileged port: Docker's daemon publishes it, not this user
            return f"cannot listen on {host}:{port} ({error.strerror}): set MMCPU_PUBLISH to a free address:port"
    return None


def mem_available_gib(meminfo: str = "/proc/meminfo") -> float | None:
    """The kernel's MemAvailable (memory that can be had without swapping), None where there is no /proc/meminfo."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        return None
    return None


def memory_problem(min_gib: float, meminfo: str = "/proc/meminfo") -> str | None:
    have = mem_available_gib(meminfo)
    if have is None or have >= min_gib:
        return None
    return (
        f"only {have:.1f} GiB of memory is available and the stack (two engines, the gateway) needs about "
        f"{min_gib:g} GiB: stop other work or use a bigger host (UP_MIN_MEM_GIB=0 make up skips this check)"
    )


def disk_problem(path: str, min_gib: float) -> str | None:
    try:
        free = shutil.disk_usage(path).free / GIB
    except OSError:
        return None  # not a local directory (a remote engine, a VM's): nothing to measure from here
    if free >= min_gib:
        return None
    return (
        f"only {free:.1f} GiB free on {path} (Docker's data) and building the image needs about {min_gib:g} GiB: "
        "free some (docker system prune) or move Docker's data-root (UP_MIN_DISK_GIB=0 make up skips this check)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -I -S -m mmcpu_dev.shell", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="fact", required=True)
    sub.add_parser("served-name").add_argument("model")
    sub.add_parser("free-port")
    sub.add_parser("human").add_argument("bytes", type=float)
    sub.add_parser("gateway-status").add_argument("url")
    port = sub.add_parser("check-port")
    port.add_argument("host")
    port.add_argument("port", type=int)
    sub.add_parser("check-memory").add_argument("min_gib", type=float)
    disk = sub.add_parser("check-disk")
    disk.add_argument("path")
    disk.add_argument("min_gib", type=float)
    args = parser.parse_args(argv)
    if args.fact == "served-name":
        print(served_name(args.model))
    elif args.fact == "free-port":
        print(free_port())
    elif args.fact == "human":
        print(human(args.bytes))
    elif args.fact == "gateway-status":
        print(gateway_status(args.url))
    else:
        problem = (
            port_problem(args.host, args.port)
            if args.fact == "check-port"
            else memory_problem(args.min_gib)
            if args.fact == "check-memory"
            else disk_problem(args.path, args.min_gib)
        )
        if problem:
            print(problem)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
