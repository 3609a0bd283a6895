"""Word timestamps for Whisper: cross-attention alignment, in the engine, with the engine's own weights.

``response_format=verbose_json`` with ``timestamp_granularities=["word"]`` (the speech package, mmcpu.stt) takes
each 30 s window's decoded text and times every word, the way openai-whisper (``timing.find_alignment``), transformers
(``_extract_token_timestamps``) and CTranslate2 (``Whisper.align``, under faster-whisper) do:

1. **engine** (:func:`worker_cross_attention`, a method of vLLM's CPU worker added by :mod:`mmcpu.plugin`, called
   by the API server with ``engine_client.collective_rpc``): one more forward pass of the loaded
   ``WhisperForConditionalGeneration`` - its encoder over the window's log-mel features (the decode's output, when
   kept: see below), then its decoder over
   ``<|startoftranscript|>[<|lang|><|task|>]<|notimestamps|> text tokens <|endoftext|>`` in plain torch (the
   decoder's own linears, layer norms and embeddings, so an int8 checkpoint runs its quantised linears) with
   explicit cross-attention, only up to the last layer that holds an alignment head. The weights of the
   model's **alignment heads** (``alignment_heads`` of its generation config, ``[[layer, head], ...]``) over the
   window's audio frames are softmaxed, normalised per head over the tokens (z-score), median filtered (width 7)
   along time and averaged over the heads: a (tokens x frames) matrix, returned to the API server.
2. **API server** (:func:`words_for_window`): dynamic time warping of that matrix against the audio frames (20 ms
   each) gives each token's first frame; tokens are merged into words as Whisper does (a new word at a leading
   space or a punctuation token; per Unicode character for languages written without spaces), punctuation is
   attached to its word, over-long words at sentence ends and after pauses are cut to twice the median word
   length, and every time is offset by the window's start.

A request without ``"word"`` pays nothing: no extra forward pass, no extra call to the engine.

The alignment reuses what the window's decode computed: its log-mel features on the API server (the feature
extractor remembers its last results, :mod:`mmcpu.features`, so :meth:`WordTimestamps.features` gets a copy of the
multimodal processor's) and its encoder output in the worker (:mod:`mmcpu.encoder_stash` keeps the last windows'
outputs, keyed by a hash of the features as the encoder received them; the alignment casts the same float32
features to the model's dtype, so the keys match). Either one recomputed on a miss, with the same result (a batched
decode's encoder output may differ from a lone window's by float rounding). The engine logs each alignment: its
time and whether the encoder output was reused.
"""

from __future__ import annotations

import logging
import string
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mmcpu.encoder_stash import Stash

# A child of vLLM's logger: the engine's lines land in its log with vLLM's format and level.
logger = logging.getLogger("vllm.mmcpu.whisper_align")

# The worker method mmcpu.plugin adds to vLLM's CPU worker (the name the API server passes to collective_rpc).
WORKER_METHOD = "mmcpu_whisper_cross_attention"

SECONDS_PER_FRAME = 0.02  # one encoder frame: two 10 ms mel hops (conv2 has stride 2)
SAMPLE_RATE = 16000
MEDIAN_FILTER_WIDTH = 7
# openai-whisper's defaults (transcribe.py): punctuation joined to the following / the previous word.
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"
# Written without spaces between words: one "word" per Unicode character (openai-whisper's tokenizer).
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})


class AlignmentError(ValueError):
    """The model cannot align words (no alignment heads, or heads outside the model)."""


def alignment_heads(generation_config: Mapping[str, Any] | None) -> list[tuple[int, int]] | None:
    """The ``alignment_heads`` of a generation config as (layer, head) pairs, or None when it has none."""
    heads = (generation_config or {}).get("alignment_heads")
    if not heads:
        return None
    try:
        pairs = [(int(layer), int(head)) for layer, head in heads]
    except (TypeError, ValueError) as exc:
        raise AlignmentError(f"alignment_heads must be [[layer, head], ...], not {heads!r}") from exc
    return sorted(set(pairs))


# ------------------------------------------------------------------------------------------------------
# 1. In the engine: the cross-attention of the alignment heads.


def worker_cross_attention(
    worker: Any,
    features: bytes,
    shape: Sequence[int],
    tokens: Sequence[int],
    heads: Sequence[Sequence[int]],
    num_frames: int,
    no_speech: int | None = None,
    reuse: bool = True,
) -> tuple[bytes, tuple[int, int]] | tuple[bytes, tuple[int, int], float]:
    """vLLM's CPU worker method (see :mod:`mmcpu.plugin`): the head-averaged, filtered cross-attention matrix
    (len(tokens) x num_frames // 2) of ``tokens`` over the window's log-mel ``features`` (float32 bytes of
    ``shape``, mel bins x 3000). Arrays travel as raw float32 bytes: vLLM's utility calls carry no array types.
    With ``no_speech`` (the ``<|nospeech|>`` token id) a third item: that token's probability after
    ``tokens[0]`` (``<|startoftranscript|>``), openai-whisper's ``no_speech_prob``, from the same encoder pass;
    ``tokens`` may then be that one token alone (no alignment: an empty matrix). The encoder's output over
    ``features`` comes from :mod:`mmcpu.encoder_stash` when the window's decode left it there (``reuse=False``: always
    computed, for comparisons)."""
    from mmcpu.encoder_stash import STASH, Stash

    t0, hits = time.perf_counter(), STASH.hits
    mel = np.frombuffer(features, dtype=np.float32).reshape(tuple(shape))
    stash = STASH if reuse else Stash()
    model = worker.model_runner.get_model()
    matrix, probability = cross_attention(model, mel, tokens, heads, num_frames, no_speech=no_speech, stash=stash)
    # One line per window: what an alignment costs the engine, and whether the decode's encoder output served it.
    logger.info(
        "Whisper alignment: %d tokens, encoder output %s, %.1f ms (stash: %d hits, %d misses)",
        len(tokens),
        "reused" if STASH.hits > hits else "computed",
        (time.perf_counter() - t0) * 1e3,
        STASH.hits,
        STASH.misses,
    )
    shape_out = (int(matrix.shape[0]), int(matrix.shape[1]))
    if no_speech is None:
        return matrix.tobytes(), shape_out
    return matrix.tobytes(), shape_out, float(probability if probability is not None else float("nan"))


def cross_attention(
    model: Any,
    features: Any,
    tokens: Sequence[int],
    heads: Sequence[Sequence[int]],
    num_frames: int,
    *,
    no_speech: int | None = None,
    stash: Stash | None = None,
) -> tuple[np.ndarray, float | None]:
    """The alignment matrix (empty when ``tokens`` is ``<|startoftranscript|>`` alone) and, with ``no_speech``,
    the probability of that token after ``tokens[0]``. The encoder's output comes from ``stash`` (default: the
    worker's :data:`mmcpu.encoder_stash.STASH`) when the window's decode left it there."""
    import torch

    from mmcpu import encoder_stash

    if not (hasattr(model, "model") and hasattr(model.model, "encoder") and hasattr(model.model, "decoder")):
        raise AlignmentError(f"{type(model).__name__} is not a Whisper encoder-decoder model")
    decoder = model.model.decoder
    layers = decoder.layers
    pairs = [(int(layer), int(head)) for layer, head in heads]
    n_heads = layers[0].encoder_attn.num_heads
    if not pairs or any(not (0 <= la < len(layers) and 0 <= h < n_heads) for la, h in pairs):
        raise AlignmentError(f"alignment heads {pairs} outside the model's {len(layers)} layers x {n_heads} heads")
    n_audio = max(1, min(int(num_frames) // 2, model.config.max_source_positions))
    last = max(la for la, _ in pairs)
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        # Cast as the model casts the processor's features for the decode: the same bytes, the same stash key.
        mel = torch.as_tensor(np.asarray(features)).to(dtype)
        # The decode's encoder output, or the encoder exactly as the engine runs it (its attention needs no forward
        # context).
        audio, _ = encoder_stash.encoder_output(model.model, mel, encoder_stash.STASH if stash is None else stash)
        probability = None if no_speech is None else _no_speech_probability(model, audio, int(tokens[0]), no_speech)
        if len(tokens) < 2:
            return np.zeros((0, n_audio), dtype=np.float32), probability
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        hidden = decoder.embed_tokens(ids) + decoder.embed_positions.weight[: len(ids)]
        weights: dict[tuple[int, int], torch.Tensor] = {}
        for index, layer in enumerate(layers[: last + 1]):
            hidden = hidden + _self_attention(layer.self_attn, layer.self_attn_layer_norm(hidden))
            out, probs = _cross_attention(layer.encoder_attn, layer.encoder_attn_layer_norm(hidden), audio)
            for la, h in pairs:
                if la == index:
                    weights[la, h] = probs[h]
            if index == last:
                break  # nothing after the last alignment head's weights is needed
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.final_layer_norm(hidden))
        w = torch.stack([weights[p] for p in pairs])[:, :, :n_audio].float()  # (heads, tokens, frames)
        # openai-whisper recomputes the softmax over the window's real frames only (the padding's share removed).
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        std, mean = torch.std_mean(w, dim=-2, keepdim=True, correction=0)
        w = (w - mean) / std.clamp_min(1e-12)
        w = median_filter(w, MEDIAN_FILTER_WIDTH)
        return w.mean(dim=0).numpy().astype(np.float32), probability


def _no_speech_probability(model: Any, audio: Any, sot: int, no_speech: int) -> float:
    """openai-whisper's ``no_speech_prob``: the softmax, at ``<|startoftranscript|>``'s position, of the
    ``<|nospeech|>`` token - the whole decoder over that one token (its logits depend on nothing after it), with the
    engine's own layers and output projection."""
    import torch

    decoder = model.model.decoder
    ids = torch.as_tensor([sot], dtype=torch.long)
    hidden = decoder.embed_tokens(ids) + decoder.embed_positions.weight[:1]
    for layer in decoder.layers:
        hidden = hidden + _self_attention(layer.self_attn, layer.self_attn_layer_norm(hidden))
        out, _ = _cross_attention(layer.encoder_attn, layer.encoder_attn_layer_norm(hidden), audio)
        hidden = hidden + out
        hidden = hidden + layer.mlp(layer.final_layer_norm(hidden))
    logits = model.compute_logits(decoder.layer_norm(hidden))
    return float(torch.softmax(logits[0].float(), dim=-1)[no_speech])


def _self_attention(attn: Any, x: Any) -> Any:
    import torch.nn.functional as F

    qkv, _ = attn.qkv_proj(x)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k, v = (t.view(t.shape[0], -1, attn.head_dim).transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    out, _ = attn.out_proj(out.transpose(0, 1).reshape(x.shape[0], -1))
    return out


def _cross_attention(attn: Any, x: Any, audio: Any) -> tuple[Any, Any]:
    import torch

    q, _ = attn.q_proj(x)
    kv, _ = attn.kv_proj(audio)
    k, v = kv.split([attn.kv_size, attn.kv_size], dim=-1)
    q, k, v = (t.view(t.shape[0], -1, attn.head_dim).transpose(0, 1) for t in (q, k, v))
    # Explicit softmax in float32: these weights are what the alignment reads.
    probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * attn.scaling, dim=-1)  # (heads, tok, 1500)
    out = (probs.to(v.dtype) @ v).transpose(0, 1).reshape(x.shape[0], -1)
    out, _ = attn.out_proj(out)
    return out, probs


def median_filter(x: Any, width: int) -> Any:
    """Median over a sliding window of odd ``width`` along the last axis, reflect-padded (openai-whisper's)."""
    import torch.nn.functional as F

    if width <= 1 or x.shape[-1] <= width // 2:
        return x
    pad = width // 2
    shape = x.shape
    padded = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).median(dim=-1).values.reshape(shape)


# ------------------------------------------------------------------------------------------------------
# 2. In the API server: DTW, words, times.


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonic alignment path of minimum total ``cost`` (rows x columns) from (0, 0) to the last cell, with
    diagonal, down and right steps; ties prefer right, then down (openai-whisper's order). Returns the path's
    row and column indices. Vectorised over anti-diagonals (a cell needs only the two diagonals before it)."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    acc[0, 0] = 0.0
    x = cost.astype(np.float64)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = x[i - 1, j - 1] + np.choose(step, (c0, c1, c2))
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def token_start_times(matrix: np.ndarray) -> np.ndarray:
    """Per row of ``matrix`` (the rows from ``<|notimestamps|>`` to the last text token), the time in seconds of
    the window at which its DTW path against the audio frames enters that row."""
    rows, cols = dtw(-matrix)
    jumps = np.diff(rows, prepend=-1).astype(bool)
    return cols[jumps] * SECONDS_PER_FRAME


@dataclass
class Word:
    word: str
    tokens: list[int]
    start: float
    end: float


def split_words(
    tokens: Sequence[int], decode: Callable[[list[int]], str], language: str | None
) -> list[tuple[str, list[int]]]:
    """Whisper's word split of text ``tokens``: (text, tokens) per word, the text with its leading space."""
    pieces = _split_on_unicode(tokens, decode)
    if language in NO_SPACE_LANGUAGES:
        return pieces
    words: list[tuple[str, list[int]]] = []
    for text, toks in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(toks)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + toks)
    return words


def _split_on_unicode(tokens: Sequence[int], decode: Callable[[list[int]], str]) -> list[tuple[str, list[int]]]:
    """Groups of tokens that decode to whole characters (a multi-byte character may span tokens)."""
    full = decode(list(tokens))
    out: list[tuple[str, list[int]]] = []
    current: list[int] = []
    offset = 0
    for token in tokens:
        current.append(token)
        text = decode(current)
        bad = text.find("\ufffd")
        if bad < 0 or (offset + bad < len(full) and full[offset + bad] == "\ufffd"):
            out.append((text, current))
            current = []
            offset += len(text)
    if current:
        out.append((decode(current), current))
    return out


def words_for_window(
    matrix: np.ndarray,
    segments: Sequence[Sequence[int]],
    decode: Callable[[list[int]], str],
    *,
    language: str | None,
    offset: float,
    duration: float,
    segment_times: Sequence[tuple[float, float]] | None = None,
    starts: np.ndarray | None = None,
) -> list[list[Word]]:
    """The words of one window, per segment of ``segments`` (each a list of text tokens, in order; together the
    rows of ``matrix`` after its first), with times in seconds of the whole audio (``offset``: the window's
    start; ``duration``: its audio length). ``segment_times``: the segments' own (start, end) in the window,
    used as openai-whisper does to correct an over-long first or last word. ``starts``: the matrix's
    :func:`token_start_times`, when the caller has them already (DTW is the costly part)."""
    text_tokens = [t for seg in segments for t in seg]
    if not text_tokens:
        return [[] for _ in segments]
    if matrix.shape[0] != len(text_tokens) + 1:
        raise AlignmentError(f"alignment matrix has {matrix.shape[0]} rows for {len(text_tokens)} text tokens")
    # Row r's query predicts text token r (row 0 is <|notimestamps|>): a word starts where the path enters the
    # row predicting its first token and ends where it enters the row predicting the next word's.
    if starts is None:
        starts = token_start_times(matrix)
    words: list[Word] = []
    segment_of: list[int] = []
    pos = 0
    for index, seg in enumerate(segments):
        for text, toks in split_words(list(seg), decode, language):
            words.append(Word(text, toks, float(starts[pos]), float(starts[pos + len(toks)])))
            segment_of.append(index)
            pos += len(toks)
    cut_long_words(words, segment_of, segment_times)
    per_segment: list[list[Word]] = [[] for _ in segments]
    for w, index in zip(_merge_punctuations(words, segment_of), segment_of, strict=True):
        if w is None:
            continue
        start = min(max(w.start, 0.0), duration)
        end = min(max(w.end, start), duration)
        per_segment[index].append(Word(w.word, w.tokens, round(offset + start, 3), round(offset + end, 3)))
    return per_segment


def cut_long_words(
    words: list[Word], segment_of: list[int], segment_times: Sequence[tuple[float, float]] | None
) -> None:
    """openai-whisper's corrections of DTW's over-long words (``add_word_timestamps``)."""
    durations = np.array([w.end - w.start for w in words])
    durations = durations[durations.nonzero()]
    if not len(durations):
        return
    median = min(0.7, float(np.median(durations)))
    longest = median * 2
    # Sentence ends: punctuation stretched over a pause.
    for i in range(1, len(words)):
        if words[i].end - words[i].start > longest:
            if words[i].word in SENTENCE_END_MARKS:
                words[i].end = words[i].start + longest
            elif words[i - 1].word in SENTENCE_END_MARKS:
                words[i].start = words[i].end - longest
    # The first (and second) word after a pause: DTW starts them where the previous speech ended.
    last_speech = 0.0
    for index in sorted(set(segment_of)):
        seg = [w for w, s in zip(words, segment_of, strict=True) if s == index and w.word.strip()]
        if not seg:
            continue
        if seg[0].end - last_speech > median * 4 and (
            seg[0].end - seg[0].start > longest or (len(seg) > 1 and seg[1].end - seg[0].start > longest * 2)
        ):
            if len(seg) > 1 and seg[1].end - seg[1].start > longest:
                boundary = max(seg[1].end / 2, seg[1].end - longest)
                seg[0].end = seg[1].start = boundary
            seg[0].start = max(0.0, seg[0].end - longest)
        if segment_times is not None:
            seg_start, seg_end = segment_times[index]
            if seg_start < seg[0].end and seg_start - 0.5 > seg[0].start:
                seg[0].start = max(0.0, min(seg[0].end - median, seg_start))
            if seg_end > seg[-1].start and seg_end + 0.5 < seg[-1].end:
                seg[-1].end = max(seg[-1].start + median, seg_end)
        last_speech = seg[-1].end


def _merge_punctuations(words: list[Word], segment_of: list[int]) -> list[Word | None]:
    """Leading punctuation joins the next word, trailing punctuation the previous one (within a segment); the
    result keeps one slot per input word, None where a word was merged away. Texts lose the leading space."""
    merged: list[Word | None] = [Word(w.word, list(w.tokens), w.start, w.end) for w in words]
    j = len(merged) - 1
    for i in range(len(merged) - 2, -1, -1):
        prev, nxt = merged[i], merged[j]
        if (
            prev is not None
            and nxt is not None
            and segment_of[i] == segment_of[j]
            and prev.word.startswith(" ")
            and prev.word.strip() in PREPEND_PUNCTUATIONS
        ):
            nxt.word, nxt.tokens, merged[i] = prev.word + nxt.word, prev.tokens + nxt.tokens, None
        else:
            j = i
    i = 0
    for j in range(1, len(merged)):
        prev, nxt = merged[i], merged[j]
        if (
            prev is not None
            and nxt is not None
            and segment_of[i] == segment_of[j]
            and not prev.word.endswith(" ")
            and nxt.word in APPEND_PUNCTUATIONS
        ):
            prev.word, prev.tokens, merged[j] = prev.word + nxt.word, prev.tokens + nxt.tokens, None
        else:
            i = j
    for k, w in enumerate(merged):
        if w is not None:
            # OpenAI's words are bare: no surrounding space or punctuation ("day", not " day.").
            w.word = w.word.strip().strip(PREPEND_PUNCTUATIONS + APPEND_PUNCTUATIONS).strip()
            if not w.word:
                merged[k] = None
    return merged


# ------------------------------------------------------------------------------------------------------
# 3. The API server's side of a request (mmcpu.stt calls this).


class WordTimestamps:
    """Word timestamps for one served Whisper model: built once by the speech-to-text serving."""

    def __init__(self, model_config: Any, tokenizer: Any) -> None:
        self.heads = alignment_heads(model_config.try_get_generation_config())
        self.model_config = model_config
        self.tokenizer = tokenizer
        ids = tokenizer.convert_tokens_to_ids
        self.sot, self.no_timestamps = ids("<|startoftranscript|>"), ids("<|notimestamps|>")
        self.timestamp_begin, self.eot = ids("<|0.00|>"), tokenizer.eos_token_id
        self._feature_extractor: Any = None

    @property
    def available(self) -> bool:
        return self.heads is not None

    def features(self, audio: np.ndarray) -> tuple[np.ndarray, int]:
        """The window's log-mel features exactly as the engine's processor computes them, and its real frames."""
        if self._feature_extractor is None:
            from vllm.transformers_utils.processor import cached_processor_from_config

            self._feature_extractor = cached_processor_from_config(self.model_config).feature_extractor
        fe = self._feature_extractor
        mel = fe(audio, sampling_rate=fe.sampling_rate, truncation=True, return_tensors="np")["input_features"][0]
        return mel.astype(np.float32), int(len(audio) // fe.hop_length)

    def alignment_tokens(self, prompt_ids: Sequence[int], text_tokens: Sequence[int]) -> tuple[list[int], int]:
        """``<|startoftranscript|>[<|lang|><|task|>]<|notimestamps|> text <|endoftext|>``: the decoder prompt's
        start-of-transcript sequence (without a ``<|startofprev|>`` prompt or timestamp), as openai-whisper."""
        prompt = list(prompt_ids)
        start = prompt.index(self.sot) if self.sot in prompt else 0
        sot_sequence = [t for t in prompt[start:] if t < self.timestamp_begin and t != self.no_timestamps]
        return [*sot_sequence, self.no_timestamps, *text_tokens, self.eot], len(sot_sequence)

    async def window(
        self,
        engine_client: Any,
        run_sync: Callable[..., Any],
        audio: np.ndarray,
        prompt_ids: Sequence[int],
        segments: Sequence[Any],
        *,
        language: str | None,
        offset: float,
    ) -> list[list[Word]]:
        """The words of each of ``segments`` (one window's, with ``tokens``, ``start``, ``end`` in seconds of the
        whole audio) of the window ``audio`` starting at ``offset``. ``run_sync(fn, *args)``: runs host work
        off the event loop (an awaitable)."""
        per_segment = [[t for t in seg.tokens if t < self.eot] for seg in segments]
        text_tokens = [t for seg in per_segment for t in seg]
        if not text_tokens:
            return [[] for _ in segments]
        mel, num_frames = await run_sync(self.features, audio)
        tokens, n_sot = self.alignment_tokens(prompt_ids, text_tokens)
        assert self.heads is not None, "callers check available first"
        heads = [list(h) for h in self.heads]
        [(raw, shape)] = await engine_client.collective_rpc(
            WORKER_METHOD, args=(mel.tobytes(), list(mel.shape), tokens, heads, num_frames)
        )
        # Rows from <|notimestamps|> to the last text token (the <|endoftext|> row predicts nothing).
        matrix = np.frombuffer(raw, dtype=np.float32).reshape(tuple(shape))[n_sot:-1]
        times = [(seg.start - offset, seg.end - offset) for seg in segments]
        return await run_sync(
            lambda: words_for_window(
                matrix,
                per_segment,
                self.decode,
                language=language,
                offset=offset,
                duration=len(audio) / SAMPLE_RATE,
                segment_times=times,
            )
        )

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)
