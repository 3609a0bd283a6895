"""Whisper's timestamp rules as a Model Runner V2 logits processor.

Whisper writes segment times as tokens (``<|0.00|>`` ... ``<|30.00|>``, 0.02 s apart) between runs of text, but
only decoding that obeys openai-whisper's ``ApplyTimestampRules`` keeps them consistent: without it a model may
emit text with no timestamps at all, a lone timestamp, or times that go backwards, and the segments built from
them lose words. The rules, per request, on the tokens generated so far:

- ``<|notimestamps|>`` and the other special tokens (language, task, start-of-transcript) never come;
- the first token is a timestamp of at most ``max_initial`` steps (1.0 s);
- timestamps come in pairs: after a closing timestamp only another timestamp or the end follows; after a pair
  (end of one segment, start of the next) text follows;
- timestamps never decrease, and a segment has a non-zero length;
- when the total probability of all timestamps exceeds that of the most likely text token, a timestamp is forced.

With a ``text`` (token ids), the text is forced: each text token must be the next one of it, the end cannot
come before all of it, and no text after it - so the model only chooses where the timestamps go. The serving
times json's own decoding of a window this way (patches/0027), so verbose_json, srt and vtt carry exactly json's
words.

Only requests whose ``SamplingParams.extra_args`` carry :data:`KEY` (set by the speech-to-text serving for its
timestamped formats: verbose_json, srt, vtt) are touched; :meth:`add_request` declines every other request, so
they pay nothing. Loaded with ``--logits-processors mmcpu.whisper_timestamps:WhisperTimestamps`` (mmcpu.launch adds
it to MRV2 engines serving speech); the V1 runner has its own interface and never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

FQCN = "mmcpu.whisper_timestamps:WhisperTimestamps"
KEY = "mmcpu_whisper_timestamps"
FIELDS = ("timestamp_begin", "eot", "no_timestamps", "max_initial")
NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>


def request_args(
    timestamp_begin: int, eot: int, no_timestamps: int, max_initial_s: float = 1.0, text: Sequence[int] | None = None
) -> dict[str, Any]:
    """The ``extra_args`` entry that turns the rules on for one request (token ids of its tokenizer); ``text``: the
    text tokens to force, in order (tokens at or above ``eot`` are not text and are left out)."""
    args: dict[str, Any] = {
        "timestamp_begin": int(timestamp_begin),
        "eot": int(eot),
        "no_timestamps": int(no_timestamps),
        "max_initial": round(max_initial_s / 0.02),
    }
    if text is not None:
        args["text"] = [int(t) for t in text if t < eot]
    return {KEY: args}


def seek_index(tokens: Sequence[int], timestamp_begin: int, eot: int) -> int | None:
    """Where openai-whisper's transcribe loop resumes after decoding a window: the index of the window's last
    timestamp token, when its tokens end unfinished - text with no closing timestamp, or a timestamp pair that
    opens a segment whose text never came (the model leaves the rest of the window's speech to the next window).
    None when they end with a lone closing timestamp (the window is done) or hold no timestamp. ``tokens`` are the
    generated ones; an ``eot`` ends them."""
    end = next((i for i, t in enumerate(tokens) if t == eot), len(tokens))
    stamps = [i for i in range(end) if tokens[i] >= timestamp_begin]
    if not stamps:
        return None
    last = stamps[-1]
    if last == end - 1 and last >= 1 and tokens[last - 1] < timestamp_begin:
        return None  # "... text <|t|>": closed
    return last


class WhisperTimestamps(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        # Per request slot: on/off and its token ids (host arrays; the batch's rows are gathered per step).
        self.active = np.zeros(req_states.max_num_reqs, dtype=bool)
        self.ids = np.zeros((req_states.max_num_reqs, len(FIELDS)), dtype=np.int64)
        self.forced: list[torch.Tensor | None] = [None] * req_states.max_num_reqs  # a slot's text to force

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = (sampling_params.extra_args or {}).get(KEY)
        if args is None:
            return
        if not isinstance(args, dict) or any(not isinstance(args.get(f), int) or args[f] < 0 for f in FIELDS):
            raise ValueError(f"extra_args[{KEY!r}] must map {', '.join(FIELDS)} to non-negative token ids")
        text = args.get("text")
        if text is not None and (
            not isinstance(text, list) or any(not isinstance(t, int) or not 0 <= t < args["eot"] for t in text)
        ):
            raise ValueError(f"extra_args[{KEY!r}]['text'] must be a list of text token ids (below eot)")

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
