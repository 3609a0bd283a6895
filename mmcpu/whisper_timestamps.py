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
come before all of it, and no text after it - so the model only chooses where the timestamps go (a request may ask
for it; the speech package's decode method, MMCPU_STT_TIMESTAMPS=decode, uses the rules without a text).

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
# Relative width within which "timestamps likelier than text" is decided on log-probabilities (openai-whisper's
# arithmetic) instead of on logits: float32 rounding of either form stays orders of magnitude below it.
TIE_TOLERANCE = 1e-4


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
    """The rules for every timestamped row of a step at once. Each row's history reduces on the host to a few
    numbers (its last two tokens, its last timestamp, how much forced text came); the rules then leave a row at
    most three allowed spans - all text or one forced token or none, the end or not, and one interval of
    timestamps - written into the logits as a handful of slice fills over the batch's rows, never a mask per rule
    and vocabulary. The "timestamps likelier than any text token" test compares ``logsumexp`` of the timestamp
    logits with the best text logit (the same test as openai-whisper's on log-probabilities: both sides differ by
    the row's log-normaliser); a row within rounding of a tie is decided openai-whisper's way, with the full
    ``log_softmax``, so the choice is exactly that of the per-rule formulation."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        # Per request slot: on/off and its token ids (host arrays; the batch's rows are gathered per step).
        self.active = np.zeros(req_states.max_num_reqs, dtype=bool)
        self.ids = np.zeros((req_states.max_num_reqs, len(FIELDS)), dtype=np.int64)
        self.forced: list[np.ndarray | None] = [None] * req_states.max_num_reqs  # a slot's text to force
        self._offsets: dict[tuple[int, str], torch.Tensor] = {}  # 0..NUM_TIMESTAMPS-1 per (width, device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = (sampling_params.extra_args or {}).get(KEY)
        if args is None:
            return
        if not isinstance(args, dict) or any(not isinstance(args.get(f), int) or args[f] < 0 for f in FIELDS):
            raise ValueError(f"extra_args[{KEY!r}] must map {', '.join(FIELDS)} to non-negative token ids")
        if not args["eot"] < args["timestamp_begin"]:  # Whisper's layout: text, the end, specials, timestamps
            raise ValueError(f"extra_args[{KEY!r}]: eot must come before timestamp_begin")
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
        self.forced[req_idx] = None if text is None else np.asarray(text, dtype=np.int64)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.active[ctx.idx_mapping_np].any():
            return logits
        # The per-row bookkeeping is a few numbers per row: numpy on the host (the runner's buffers are host memory
        # on CPU; elsewhere this copies a few hundred ints), where torch would pay its per-op dispatch many times.
        slots_all = ctx.expanded_idx_mapping.cpu().numpy()
        rows = np.flatnonzero(self.active[slots_all])
        slots = slots_all[rows]
        ids = self.ids[slots]
        tb, eot, no_ts, max_initial = ids.T
        n = rows.size
        r = np.arange(n)

        # The tokens so far, prompt included: the committed ones, with this step's input token at its position.
        seq_len = ctx.pos.cpu().numpy()[rows].astype(np.int64) + 1
        prompt_len = self.req_states.prompt_len.gpu.cpu().numpy()[slots].astype(np.int64)
        start = max(int(prompt_len.min()) - 1, 0)  # from the input token of a first step on
        hist = self.req_states.all_token_ids.gpu[torch.from_numpy(slots), start : int(seq_len.max())]
        hist = hist.cpu().numpy().astype(np.int64)  # a copy: this step's input token goes in below
        hist[r, seq_len - 1 - start] = ctx.input_ids.cpu().numpy()[rows]
        j = np.arange(start, start + hist.shape[1])
        generated = (j >= prompt_len[:, None]) & (j < seq_len[:, None])
        is_stamp = generated & (hist >= tb[:, None]) & (hist < (tb + NUM_TIMESTAMPS)[:, None])
        max_ts = np.where(is_stamp, hist, -1).max(axis=1, initial=-1)  # timestamps never decrease: the last one
        n_gen = seq_len - prompt_len
        last = hist[r, seq_len - 1 - start]
        penult = hist[r, np.maximum(seq_len - 2 - start, 0)]
        last_ts = (n_gen >= 1) & (last >= tb)
        penult_ts = (n_gen < 2) | (penult >= tb)
        pair = last_ts & penult_ts  # a pair just closed: text (or the end) must follow
        lone = last_ts & ~penult_ts  # a lone closing timestamp: a timestamp or the end
        first = n_gen == 0  # the first token: a timestamp within max_initial of the window's start

        # Forced text: its next token while some is left, else no text and the end allowed.
        forced = np.array([self.forced[s] is not None for s in slots.tolist()], dtype=bool)
        nxt = np.full(n, -1, dtype=np.int64)
        if forced.any():
            done = (generated & (hist < eot[:, None])).sum(axis=1)
            for i in np.flatnonzero(forced).tolist():
                text = self.forced[slots[i]]
                assert text is not None
                if done[i] < text.size:
                    nxt[i] = text[done[i]]
        left = nxt >= 0

        # What each row may take: all text / one text token / none; the end or not; one interval of timestamps.
        text_all = ~(lone | first | forced)
        one = np.where(~(lone | first) & forced & left, nxt, -1)
        eot_ok = ~(first | (forced & left))
        floor = np.where(max_ts < 0, tb, np.where(lone, max_ts, max_ts + 1))
        hi = np.where(first, np.minimum(tb + max_initial, tb + NUM_TIMESTAMPS - 1), tb + NUM_TIMESTAMPS - 1)
        lo = np.where(pair, hi + 1, floor)  # after a pair: none

        device = logits.device
        whole = n == logits.shape[0]  # every row timestamped (as at a batch of verbose_json): edit in place
        sub = logits if whole else logits[torch.from_numpy(rows).to(device)]
        keys = ids[:, :3]
        for key in np.unique(keys, axis=0):  # one group per tokenizer: one in practice
            group = np.flatnonzero((keys == key).all(axis=1))
            if group.size == n:
                self._apply_group(sub, tuple(key.tolist()), text_all, one, eot_ok, lo, hi)
            else:
                g = torch.from_numpy(group).to(device)
                part = sub[g]
                self._apply_group(
                    part, tuple(key.tolist()), text_all[group], one[group], eot_ok[group], lo[group], hi[group]
                )
                sub[g] = part
        if not whole:
            logits[torch.from_numpy(rows).to(device)] = sub
        return logits

    def _apply_group(
        self,
        sub: torch.Tensor,
        key: tuple[int, ...],
        text_all: np.ndarray,
        one: np.ndarray,
        eot_ok: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
    ) -> None:
        """Rows sharing one tokenizer's ids, edited in place: the rules' spans, then the forcing of a timestamp."""
        tb, eot, no_ts = key
        device, width = sub.device, sub.shape[1]
        ts_end = min(tb + NUM_TIMESTAMPS, width)
        inf = float("-inf")

        def col(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)[:, None]

        # Text: every row keeps all of it, one token of it, or none.
        single = np.flatnonzero(one >= 0)
        if single.size:
            at = (torch.from_numpy(single).to(device), torch.from_numpy(one[single]).to(device))
            kept = sub[at]
        if not text_all.all():
            sub[:, :eot].masked_fill_(~col(text_all), inf)
        if single.size:
            sub[at] = kept
        if not eot_ok.all():
            sub[:, eot].masked_fill_(~torch.from_numpy(eot_ok).to(device), inf)
        sub[:, eot + 1 : tb] = inf  # <|notimestamps|>, language, task, start-of-transcript ...
        sub[:, ts_end:] = inf
        sub[:, no_ts] = inf
        offsets = self._offsets.get((ts_end - tb, str(device)))
        if offsets is None:
            offsets = self._offsets[(ts_end - tb, str(device))] = torch.arange(ts_end - tb, device=device)[None, :]
        stamps = sub[:, tb:ts_end]
        stamps.masked_fill_((offsets < col(lo - tb)) | (offsets > col(hi - tb)), inf)

        # A timestamp is forced where all of them together are likelier than the best text token (or the end).
        ts_mass = torch.logsumexp(stamps, dim=-1)
        best_text = sub[:, :tb].max(dim=-1).values
        force = ts_mass > best_text
        close = torch.isfinite(ts_mass) & torch.isfinite(best_text)
        close &= (ts_mass - best_text).abs() <= TIE_TOLERANCE * (1 + ts_mass.abs() + best_text.abs())
        if bool(close.any()):  # within rounding of a tie: openai-whisper's own arithmetic on log-probabilities
            near = close.nonzero().squeeze(1)
            logprobs = torch.log_softmax(sub[near], dim=-1)
            v = torch.arange(width, device=device)
            # Whole rows masked, not slices: the same reduction, in the same order, as the per-rule form.
            ts_lp = torch.logsumexp(logprobs.masked_fill((v < tb) | (v >= ts_end), inf), dim=-1)
            force[near] = ts_lp > logprobs.masked_fill(v >= tb, inf).max(dim=-1).values
        sub[:, :tb].masked_fill_(force[:, None], inf)
