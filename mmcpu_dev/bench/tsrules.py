"""The timestamp-rule logits processor's cost: ``python -m mmcpu_dev.bench.tsrules [micro|engine|all]``.

``micro``: the processor alone in this process (:class:`mmcpu.whisper_timestamps.WhisperTimestamps`) against the
per-rule formulation it replaced (:class:`PerRuleReference`, kept verbatim), on Whisper's vocabulary (tiny.en's
token ids), 1 and 8 timestamped rows, mid-decode histories; median of many calls, one torch thread per CPU as vLLM.

``engine``: a whisper-tiny.en engine (MRV2, the processor loaded as ``mmcpu-serve`` loads it), ``--c`` concurrent
requests of the same clip, ``json`` (no rules) against ``verbose_json`` (every step of every request under the
rules); the step time is vLLM's own inter-token latency (the ``/metrics`` histogram, deltas over the measured
rounds). Both print a JSON record; ``--json PATH`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from mmcpu.whisper_timestamps import FIELDS, KEY, NUM_TIMESTAMPS, WhisperTimestamps, request_args

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

# whisper-tiny.en's tokenizer: <|endoftext|>, <|notimestamps|>, <|0.00|>, and the logits' width.
TINY_EN = {"timestamp_begin": 50363, "eot": 50256, "no_timestamps": 50362, "vocab": 51864}


def batch(
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    slots: Sequence[int] | None = None,
    max_num_reqs: int | None = None,
) -> tuple[Any, Any]:
    """The runner's state as a logits processor sees it (``LogitsProcRequestState``, ``LogitsContext``) for rows
    whose tokens so far are ``histories`` (prompt included; the last token is this step's input), row i in request
    slot ``slots[i]``."""
    n = len(histories)
    slots = list(range(n)) if slots is None else list(slots)
    max_num_reqs = max_num_reqs or max(slots) + 1
    width = max(len(h) for h in histories) + 1
    tokens = torch.zeros((max_num_reqs, width), dtype=torch.int32)
    prompt = torch.zeros(max_num_reqs, dtype=torch.int32)
    for h, s, p in zip(histories, slots, prompt_lens, strict=True):
        tokens[s, : len(h) - 1] = torch.tensor(h[:-1], dtype=torch.int32)  # the input token is not committed yet
        prompt[s] = p
    states = SimpleNamespace(
        max_num_reqs=max_num_reqs,
        all_token_ids=SimpleNamespace(gpu=tokens),
        prompt_len=SimpleNamespace(gpu=prompt),
    )
    mapping = torch.tensor(slots, dtype=torch.int32)
    ctx = SimpleNamespace(
        expanded_idx_mapping=mapping,
        idx_mapping=mapping,
        idx_mapping_np=mapping.numpy(),
        pos=torch.tensor([len(h) - 1 for h in histories], dtype=torch.int64),
        input_ids=torch.tensor([h[-1] for h in histories], dtype=torch.int32),
    )
    return states, ctx


class PerRuleReference(LogitsProcessor):
    """The processor as first written (kept verbatim as the reference of the differential tests and of this
    benchmark): every rule a [rows, vocab] mask, the forcing on a full ``log_softmax``."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        # Per request slot: on/off and its token ids (host arrays; the batch's rows are gathered per step).
        self.active = np.zeros(req_states.max_num_reqs, dtype=bool)
        self.ids = np.zeros((req_states.max_num_reqs, len(FIELDS)), dtype=np.int64)
        self.forced: list[torch.Tensor | None] = [None] * req_states.max_num_reqs  # a slot's text to force

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        args = (sampling_params.extra_args or {}).get(KEY)
        self.active[req_idx] = args is not None
        if args is None:
            return False
        self.ids[req_idx] = [args[f] for f in FIELDS]
        text = args.get("text")
        self.forced[req_idx] = None if text is None else torch.tensor(text, dtype=torch.long)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.active[ctx.idx_mapping_np].any():
            return logits
        device = logits.device
        slots_all = ctx.expanded_idx_mapping
        active = torch.from_numpy(self.active).to(device)[slots_all]
        rows = active.nonzero().squeeze(1)
        slots = slots_all[rows].long()
        ids = torch.from_numpy(self.ids).to(device)[slots]
        tb, eot, no_ts, max_initial = (ids[:, i : i + 1] for i in range(len(FIELDS)))
        n = rows.numel()
        r = torch.arange(n, device=device)

        # The tokens so far, prompt included: the committed ones, with this step's input token at its position.
        seq_len = ctx.pos[rows].long() + 1
        hist = self.req_states.all_token_ids.gpu[slots, : int(seq_len.max())].long().clone()
        hist[r, seq_len - 1] = ctx.input_ids[rows].long()
        prompt_len = self.req_states.prompt_len.gpu[slots].long()
        j = torch.arange(hist.shape[1], device=device)
        generated = (j >= prompt_len[:, None]) & (j < seq_len[:, None])
        hist_ts = generated & (hist >= tb) & (hist < tb + NUM_TIMESTAMPS)
        n_gen = seq_len - prompt_len
        last = hist[r, seq_len - 1]
        penult = hist[r, (seq_len - 2).clamp(min=0)]
        last_ts = (n_gen >= 1) & (last >= tb[:, 0])
        penult_ts = (n_gen < 2) | (penult >= tb[:, 0])
        max_ts = torch.where(hist_ts, hist, -1).max(dim=1).values  # timestamps never decrease: the last one

        v = torch.arange(logits.shape[1], device=device)[None, :]
        is_ts = (v >= tb) & (v < tb + NUM_TIMESTAMPS)
        is_text = v < eot
        banned = (v == no_ts) | ((v > eot) & (v < tb)) | (v >= tb + NUM_TIMESTAMPS)
        # A pair just closed: text (or the end) must follow. A lone closing timestamp: a timestamp or the end.
        banned |= (last_ts & penult_ts)[:, None] & is_ts
        banned |= (last_ts & ~penult_ts)[:, None] & is_text
        # Non-decreasing, and a segment that has text since its start timestamp cannot end where it started.
        floor = torch.where(last_ts & ~penult_ts, max_ts, max_ts + 1)
        banned |= ((max_ts >= 0)[:, None]) & is_ts & (v < floor[:, None])
        # The first token: a timestamp within max_initial of the window's start.
        first = (n_gen == 0)[:, None]
        banned |= first & (~is_ts | (v > tb + max_initial))
        banned |= self._forced_text_bans(slots, generated & (hist < eot), v, eot)

        sub = logits[rows].masked_fill(banned, float("-inf"))
        logprobs = torch.log_softmax(sub, dim=-1)
        ts_logprob = torch.logsumexp(logprobs.masked_fill(~is_ts, float("-inf")), dim=-1)
        text_logprob = logprobs.masked_fill(v >= tb, float("-inf")).max(dim=-1).values
        force = (ts_logprob > text_logprob)[:, None] & (v < tb)
        logits[rows] = sub.masked_fill(force, float("-inf"))
        return logits

    def _forced_text_bans(
        self, slots: torch.Tensor, text_so_far: torch.Tensor, v: torch.Tensor, eot: torch.Tensor
    ) -> torch.Tensor | bool:
        """Rows with a forced text: while some is left, every text token but its next one, and the end; after it,
        all text. ``text_so_far``: the rows' generated text tokens (mask over their history)."""
        forced = [self.forced[s] for s in slots.tolist()]
        if all(f is None for f in forced):
            return False
        done = text_so_far.sum(dim=1).tolist()
        nxt = torch.full((len(forced), 1), -1, dtype=torch.long, device=v.device)  # -1: no text may come
        rows = torch.zeros((len(forced), 1), dtype=torch.bool, device=v.device)
        for i, (f, k) in enumerate(zip(forced, done, strict=True)):
            if f is not None:
                rows[i] = True
                if k < len(f):
                    nxt[i] = f[k]
        left = nxt >= 0
        return rows & (((v < eot) & (v != nxt)) | (left & (v == eot)))


# --- the processor alone -------------------------------------------------------------------------------------
def mid_decode(rows: int, forced: bool, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """``rows`` tiny.en histories mid-window: the prompt, then ~60 generated tokens of text between timestamp pairs,
    ending in text (the common step: text, a timestamp or the end may come); with ``forced``, that text forced."""
    from vllm.sampling_params import SamplingParams

    ids = TINY_EN
    rng = np.random.default_rng(seed)
    prompt = [50257, 50362 - 4, 50362 - 3]  # start-of-transcript, language, task: any non-text ids do
    histories, params = [], []
    for _ in range(rows):
        gen, text, t = [], [], 0
        while len(gen) < 60:
            gen.append(ids["timestamp_begin"] + t)
            words = rng.integers(0, ids["eot"], size=int(rng.integers(3, 12))).tolist()
            gen += words
            text += words
            t += int(rng.integers(20, 150))
            gen.append(ids["timestamp_begin"] + t)
        gen += rng.integers(0, ids["eot"], size=3).tolist()
        text += gen[-3:] + rng.integers(0, ids["eot"], size=5).tolist()
        histories.append(prompt + gen)
        params.append(
            SamplingParams(
                extra_args=request_args(
                    ids["timestamp_begin"], ids["eot"], ids["no_timestamps"], text=text if forced else None
                )
            )
        )
    return histories, params


def micro(rows_list: Sequence[int] = (1, 8), calls: int = 300) -> list[dict[str, Any]]:
    """Median microseconds per ``apply`` of the batched processor and of the per-rule reference."""
    out = []
    for rows in rows_list:
        for forced in (False, True):
            histories, params = mid_decode(rows, forced)
            states, ctx = batch(histories, [3] * rows)
            logits = torch.randn((rows, TINY_EN["vocab"]), generator=torch.Generator().manual_seed(rows)) * 3
            rec: dict[str, Any] = {"rows": rows, "forced_text": forced}
            for name, cls in (("batched", WhisperTimestamps), ("per_rule", PerRuleReference)):
                proc = cls(None, states)
                for s, p in enumerate(params):
                    proc.add_request(s, p)
                times = []
                for i in range(calls + 10):
                    x = logits.clone()
                    t0 = time.perf_counter()
                    proc.apply(x, ctx)
                    if i >= 10:  # warm-up calls left out
                        times.append(time.perf_counter() - t0)
                rec[f"{name}_us"] = round(1e6 * statistics.median(times), 1)
            rec["speedup"] = round(rec["per_rule_us"] / rec["batched_us"], 1)
            out.append(rec)
    return out


# --- a real engine ------------------------------------------------------------------------------------------
def engine(c: int, rounds: int, out_dir: Path, processor_from: str | None = None) -> dict[str, Any]:
    """``c`` concurrent transcriptions of one ~20 s clip (one window), json then verbose_json, ``rounds`` times
    alternating; per format: vLLM's inter-token latency (mean decode step), generated tokens, wall time.
    ``processor_from``: a git revision whose mmcpu/whisper_timestamps.py the engine loads instead (the rest of the
    package as checked out), to measure an earlier processor on the same engine setup."""
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from mmcpu.config import REPO_ROOT, get_settings
    from mmcpu_dev import timestamps
    from mmcpu_dev.bench.c1profile import mean_of, scrape
    from mmcpu_dev.servers import Engine

    settings = get_settings()
    out_dir.mkdir(parents=True, exist_ok=True)
    clip, seconds = timestamps.clip("tsrules-s6", 6, 160, out_dir)
    overlay = None
    if processor_from:
        overlay = out_dir / "overlay"
        shutil.rmtree(overlay, ignore_errors=True)
        shutil.copytree(REPO_ROOT / "mmcpu", overlay / "mmcpu")
        old = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "show", f"{processor_from}:mmcpu/whisper_timestamps.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (overlay / "mmcpu" / "whisper_timestamps.py").write_text(old)
    eng = Engine(
        settings.models_dir / "whisper-tiny.en",
        out_dir / f"tsrules-engine{'-' + processor_from if processor_from else ''}.log",
        pythonpath=overlay,
        env={"MMCPU_MM_CACHE_GIB": "0.5"},
    )
    res: dict[str, Any] = {"c": c, "rounds": rounds, "clip_s": round(seconds, 1), "processor_from": processor_from}
    fmts = ("json", "verbose_json")
    try:
        eng.start()

        def one(fmt: str) -> object:
            return timestamps.transcribe(eng.base_url, eng.name, clip, fmt)

        with ThreadPoolExecutor(c) as pool:
            for fmt in fmts:  # warm-up
                list(pool.map(one, [fmt] * c))
            acc = {f: {"itl": [], "tokens": 0.0, "wall": []} for f in fmts}
            for _ in range(rounds):
                for fmt in fmts:
                    before = scrape(eng.base_url)
                    t0 = time.perf_counter()
                    list(pool.map(one, [fmt] * c))
                    acc[fmt]["wall"].append(time.perf_counter() - t0)
                    after = scrape(eng.base_url)
                    acc[fmt]["itl"].append(mean_of(before, after, "inter_token_latency_seconds"))
                    acc[fmt]["tokens"] += (
                        after["request_generation_tokens_sum"] - before["request_generation_tokens_sum"]
                    )
        for fmt in fmts:
            a = acc[fmt]
            res[fmt] = {
                "step_ms": round(1e3 * statistics.median(a["itl"]), 3),
                "step_ms_rounds": [round(1e3 * x, 3) for x in a["itl"]],
                "tokens_per_request": round(a["tokens"] / (rounds * c), 1),
                "wall_s": round(statistics.median(a["wall"]), 3),
            }
        res["step_overhead"] = round(res["verbose_json"]["step_ms"] / res["json"]["step_ms"] - 1, 4)
    finally:
        eng.stop()
    return res


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    from mmcpu.config import get_settings

    ap = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench.tsrules", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("micro", "engine", "all"), default="all")
    ap.add_argument("--c", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--processor-from", help="a git revision: the engine loads that revision's processor")
    ap.add_argument("--out", type=Path, default=get_settings().cache_dir / "bench-tsrules")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res: dict[str, Any] = {
        "cpu": cpu_name(),
        "load_before": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
    }
    if args.what in ("micro", "all"):
        res["micro"] = micro(calls=args.calls)
    if args.what in ("engine", "all"):
        res["engine"] = engine(args.c, args.rounds, args.out, args.processor_from)
    res["load_after"] = os.getloadavg()[0]
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
