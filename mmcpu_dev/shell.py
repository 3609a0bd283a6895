"""What scripts/docker-e2e asks Python for, so the shell does not restate facts the Python side owns:

    python -m mmcpu_dev.shell served-name MODEL   the name clients address MODEL by (mmcpu.launch.served_name)
    python -m mmcpu_dev.shell free-port           a free loopback port (mmcpu_dev.servers.free_port)
    python -m mmcpu_dev.shell human BYTES         bytes as the e2e figures print them (1.50KiB, 2.41GiB)
"""

from __future__ import annotations

import argparse
import sys


def human(n: float) -> str:
    """Bytes in binary units with two decimals (numfmt --to=iec-i --suffix=B --format=%.2f), bytes as a whole."""
    for unit in ("", "Ki", "Mi", "Gi"):
        if n < 1024 or unit == "Gi":
            return f"{n:.2f}{unit}B" if unit else f"{n:.0f}B"
        n /= 1024
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.shell", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="fact", required=True)
    sub.add_parser("served-name").add_argument("model")
    sub.add_parser("free-port")
    sub.add_parser("human").add_argument("bytes", type=float)
    args = parser.parse_args(argv)
    if args.fact == "served-name":
        from mmcpu.launch import served_name

        print(served_name(args.model))
    elif args.fact == "free-port":
        from mmcpu_dev.servers import free_port

        print(free_port())
    else:
        print(human(args.bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
