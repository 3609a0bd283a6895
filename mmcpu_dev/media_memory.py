"""What one chat request at the media limits costs an engine in memory: the peak RSS it adds, per process.

    python -m mmcpu_dev.media_memory --base-url http://127.0.0.1:8002 --pid ENGINE_PID --model tiny-llava

Each request is a worst case at the defaults (or the given limits): MMCPU_MAX_IMAGES images, each exactly at
MMCPU_MAX_IMAGE_PIXELS, in the pixel mode that costs the most to convert (RGBA, palette, 1-bit, RGB), all of one
colour so they are tiny on the wire and whole when decoded. Linux keeps each process's peak RSS (VmHWM) and resets it
on request (``/proc/PID/clear_refs`` with 5): the figure is the peak during the request less the RSS before it,
summed over the engine's processes (the API server decodes and preprocesses images; the EngineCore receives the
processed tensors). Needs to run as the engine's user (root here) on the same host.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from dataclasses import dataclass

import httpx
from PIL import Image

from mmcpu.proc import tree
from mmcpu_dev.payloads import image_chat_kwargs, image_data_url

MODES = ("RGBA", "P", "1", "RGB")


@dataclass(frozen=True)
class Cost:
    mode: str
    status: int
    peak_growth: dict[int, int]  # pid -> bytes above its RSS before the request
    peak: dict[int, int]  # pid -> its peak RSS during the request

    @property
    def total(self) -> int:
        return sum(self.peak_growth.values())


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def side_for(max_pixels: int) -> tuple[int, int]:
    """The largest width x height at most ``max_pixels``, as square as it gets."""
    width = math.isqrt(max_pixels)
    return width, max_pixels // width


def image_at_limit(mode: str, max_pixels: int, seed: int = 0) -> str:
    """One colour per seed, so the images of a request differ (vLLM's processor cache keys on their content)."""
    buf = io.BytesIO()
    fill = {"RGBA": (seed, 20, 30, 128), "P": seed % 256, "1": seed % 2, "RGB": (seed, 20, 30)}[mode]
    Image.new(mode, side_for(max_pixels), fill).save(buf, format="PNG")
    return image_data_url(buf.getvalue())


def measure(
    base_url: str, pid: int, model: str, *, max_images: int, max_pixels: int, mode: str, api_key: str = "unused"
) -> Cost:
    images = [image_at_limit(mode, max_pixels, seed) for seed in range(max_images)]
    body = image_chat_kwargs(images, model=model, max_tokens=1)
    processes = [p.pid for p in tree(pid)]
    before = {}
    for p in processes:
        with open(f"/proc/{p}/clear_refs", "w") as f:
            f.write("5")
        before[p] = _status(p, "VmRSS")
    response = httpx.post(
        f"{base_url.rstrip('/')}/v1/chat/completions",
        json=body,
        timeout=600,
        headers={"Authorization": f"Bearer {api_key}"},
    )
    peak = {p: _status(p, "VmHWM") for p in processes}
    return Cost(mode, response.status_code, {p: max(0, peak[p] - before[p]) for p in processes}, peak)


def main(argv: list[str] | None = None) -> int:
    from mmcpu.config import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the engine (not the gateway): its processes are measured")
    parser.add_argument("--pid", type=int, required=True, help="the engine's launcher or API server PID")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-images", type=int, default=settings.max_images)
    parser.add_argument("--max-pixels", type=int, default=settings.max_image_pixels)
    parser.add_argument("--memory-limit-gib", type=float, default=3.0, help="the engine's limit (compose: 3)")
    args = parser.parse_args(argv)
    # A small request first, so one-time costs (lazy imports, the loader's threads) are not counted as the limits'.
    httpx.post(
        f"{args.base_url.rstrip('/')}/v1/chat/completions",
        timeout=600,
        json=image_chat_kwargs([image_at_limit("RGB", 96 * 96)], model=args.model, max_tokens=1),
    )
    processes = [p.pid for p in tree(args.pid)]
    baseline = {p: _status(p, "VmRSS") for p in processes}
    worst = held = 0
    for i, mode in enumerate(MODES):
        # One row fewer per mode: no image of one request is in the processor cache from an earlier one.
        cost = measure(
            args.base_url,
            args.pid,
            args.model,
            max_images=args.max_images,
            max_pixels=args.max_pixels - i * side_for(args.max_pixels)[0],
            mode=mode,
        )
        worst = max(worst, cost.total)
        # glibc keeps freed heap, so a later request's own growth reads smaller than the first's: its peak over the
        # RSS after the warm-up request is the figure that counts against the engine's memory limit.
        held = max(held, sum(max(0, cost.peak[p] - baseline.get(p, cost.peak[p])) for p in cost.peak))
        print(
            json.dumps(
                {
                    "mode": mode,
                    "status": cost.status,
                    "request_growth_mib": round(cost.total / 2**20, 1),
                    "per_process_mib": {p: round(b / 2**20, 1) for p, b in cost.peak_growth.items()},
                }
            ),
            flush=True,
        )
    peak = max(worst, held)
    print(
        json.dumps(
            {
                "max_images": args.max_images,
                "max_image_pixels": args.max_pixels,
                "worst_request_growth_mib": round(worst / 2**20, 1),
                "peak_over_warm_baseline_mib": round(held / 2**20, 1),
                "share_of_limit": round(peak / (args.memory_limit_gib * 2**30), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
