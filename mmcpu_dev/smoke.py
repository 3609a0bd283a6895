"""The compose smoke check: ``python -m mmcpu_dev.smoke [--base-url http://gateway:8000/v1]``.

Talks to the gateway the way a user does, with the unmodified ``openai`` client and the project's request
builders (mmcpu_dev.payloads) and speech (mmcpu_dev.speech):
  - transcriptions of espeak-ng sentences: WER over all of them, and the json / text / srt / vtt formats,
    each checked for being well formed and saying the same words;
  - image chats with two different images in one request; other images must give another answer;
  - one transcription and one two-image chat at the same time;
  - bad inputs (empty file, non-audio bytes, malformed data URL, unknown model) must get 4xx OpenAI-style
    errors, and a good request must still succeed afterwards.
  - when mmcpu_dev.hard_inputs exists: every case of its catalogue through the gateway (each must get its 4xx,
    and the engines must still answer afterwards).
One line per check; exit 0 only if every check passes. MRV2 evidence is in the engines' logs, which this
container cannot see: ``make e2e`` checks them after the smoke has passed.

Two more modes for ``make e2e``'s fault tests (tests/e2e):
  --load N [--concurrency C]   a bounded mixed load (audio and vision; half of each with sampling options,
                               temperature 0.8 / top_p 0.9); one ``[load] {json}`` line per request with its
                               wall-clock start/end, then a summary with p50/p95; exit 0 only with 0 failures.
                               --duration-s S and --stop-file F end it early: no request starts after S seconds
                               or once F exists (how ``make e2e`` ends a load when it has seen what it needs)
  --long-s S                   one transcription of an S-second espeak clip (``[long]`` lines): the request
                               during which ``make e2e`` stops the audio engine, which must let it finish
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from mmcpu.config import get_settings
from mmcpu.launch import served_name
from mmcpu_dev import speech
from mmcpu_dev.bench.stats import percentile
from mmcpu_dev.checks import WER_LIMIT, CheckFailed, expect_client_error, subtitle_text
from mmcpu_dev.payloads import image_chat_kwargs, test_image, transcription_kwargs

N_SENTENCES = 4  # >= 3 sentences; each MRV2 transcription takes a few seconds on CPU


# --- the run -------------------------------------------------------------------------------------
class Smoke:
    def __init__(self, client: openai.OpenAI, audio_model: str, vision_model: str, workdir: Path):
        self.client = client
        self.audio_model = audio_model
        self.vision_model = vision_model
        self.workdir = workdir
        self.results: list[bool] = []
        self._clips: list[tuple[Path, str]] | None = None

    def check(self, name: str, fn: Callable[[], str]) -> None:
        """Run one check; print ``PASS name (time): detail`` or ``FAIL name (time): reason``."""
        t0 = time.monotonic()
        try:
            detail, ok = fn(), True
        except openai.APIStatusError as exc:
            detail, ok = f"HTTP {exc.status_code}: {exc.response.text[:300]}", False
        except Exception as exc:
            detail, ok = f"{type(exc).__name__}: {str(exc)[:300]}", False
        self.results.append(ok)
        print(f"[smoke] {'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - t0:.1f}s): {detail}", flush=True)

    @property
    def clips(self) -> list[tuple[Path, str]]:
        if self._clips is None:
            self._clips = [
                (speech.synthesize(text, self.workdir / f"clip{i}.wav"), text)
                for i, text in enumerate(speech.SENTENCES[:N_SENTENCES])
            ]
        return self._clips

    def transcribe(self, audio: Path | bytes, response_format: str = "json", model: str | None = None) -> str:
        result = self.client.audio.transcriptions.create(
            **transcription_kwargs(
                audio, model=model or self.audio_model, language="en", response_format=response_format
            )
        )
        return result if isinstance(result, str) else result.text

    def chat(self, images: list, model: str | None = None) -> str:
        result = self.client.chat.completions.create(**image_chat_kwargs(images, model=model or self.vision_model))
        content = result.choices[0].message.content
        if not content or not content.strip():
            raise CheckFailed(f"empty answer: {result!r}")
        return content

    # -- checks --
    def models_listed(self) -> str:
        ids = sorted(m.id for m in self.client.models.list())
        missing = {self.audio_model, self.vision_model} - set(ids)
        if missing:
            raise CheckFailed(f"/v1/models lacks {sorted(missing)}: {ids}")
        return f"{ids}"

    def both_at_once(self) -> str:
        """A transcription and a two-image chat in flight together: the gateway serves both engines at once.
        (Also the regression run's proof: the unpatched engines each answer their first such request with
        HTTP 500 and then exit, which stops the whole compose stack.)"""
        with ThreadPoolExecutor(2) as pool:
            futures = {
                "audio": pool.submit(self.transcribe, self.clips[0][0]),
                "vision": pool.submit(self.chat, [test_image(1), test_image(2)]),
            }
            results, errors = {}, []
            for name, future in futures.items():
                try:
                    results[name] = future.result()
                except openai.APIStatusError as exc:
                    errors.append(f"{name}: HTTP {exc.status_code}: {exc.response.text[:100]}")
        if errors:
            raise CheckFailed("; ".join(errors))
        self._same_words("json", results["audio"])
        return f"audio {results['audio']!r}, vision {results['vision']!r}"

    def transcription_json(self) -> str:
        hyps = [self.transcribe(path) for path, _ in self.clips]
        if not all(h.strip() for h in hyps):
            raise CheckFailed(f"empty transcription among {hyps}")
        wer = speech.word_error_rate([t for _, t in self.clips], hyps)
        if wer >= WER_LIMIT:
            raise CheckFailed(f"WER {wer:.3f} >= {WER_LIMIT}: {hyps}")
        return f"WER {wer:.3f} over {len(hyps)} sentences: {hyps[0]!r}"

    def _same_words(self, fmt: str, text: str) -> None:
        path, reference = self.clips[0]
        wer = speech.word_error_rate([reference], [text])
        if wer >= WER_LIMIT:
            raise CheckFailed(f"{fmt}: WER {wer:.3f} >= {WER_LIMIT}: {text!r}")

    def transcription_text(self) -> str:
        body = self.transcribe(self.clips[0][0], "text")
        if not body.strip() or body.lstrip().startswith(("{", "[")):
            raise CheckFailed(f"text format is not plain text: {body[:200]!r}")
        self._same_words("text", body)
        return repr(body.strip())

    def transcription_subtitles(self, fmt: str) -> Callable[[], str]:
        def run() -> str:
            body = self.transcribe(self.clips[0][0], fmt)
            text = subtitle_text(body, fmt)  # raises unless numbering, timestamps and order are right
            self._same_words(fmt, text)
            return repr(body.strip().split("\n\n")[-1])

        return run

    def vision_two_images(self) -> str:
        first = self.chat([test_image(1), test_image(2)])
        again = self.chat([test_image(1), test_image(2)])
        other = self.chat([test_image(3), test_image(4)])
        if again != first:
            raise CheckFailed(f"greedy answers differ for the same images: {first!r} vs {again!r}")
        if other == first:
            raise CheckFailed(f"other images gave the same answer {first!r}: the images do not reach the model")
        return f"{first!r} / other images: {other!r}"

    def chat_default_sampling(self) -> str:
        """A chat as the openai client sends it by default: no temperature (1.0), plus top_p and a seed. Under
        Triton's interpreter this request killed the engine; with native kernels it must answer, reproducibly."""
        kwargs = image_chat_kwargs([test_image(7)], model=self.vision_model)
        del kwargs["temperature"]
        answers = [self.client.chat.completions.create(**kwargs, seed=3).choices[0].message.content for _ in (0, 1)]
        nucleus = self.client.chat.completions.create(**kwargs, top_p=0.9).choices[0].message.content
        if not answers[0] or answers[0] != answers[1] or not nucleus:
            raise CheckFailed(f"default sampling: {answers!r}, top_p: {nucleus!r}")
        return f"{answers[0]!r} (same for the same seed), top_p 0.9: {nucleus!r}"

    def transcription_sampled(self) -> str:
        path, reference = self.clips[0]
        result = self.client.audio.transcriptions.create(
            **transcription_kwargs(path, model=self.audio_model, language="en", temperature=0.4)
        )
        wer = speech.word_error_rate([reference], [result.text])
        if wer >= 2 * WER_LIMIT:  # sampling may change a word or two; a broken path loses the sentence
            raise CheckFailed(f"temperature 0.4: WER {wer:.3f}: {result.text!r}")
        return f"temperature 0.4: {result.text!r}"

    def bad(self, call: Callable[[], object], statuses: range | set[int] = range(400, 500)) -> Callable[[], str]:
        def run() -> str:
            error = expect_client_error(call, statuses)
            return f"{error.get('type')}: {error['message'][:120]!r}"

        return run

    def still_serving(self) -> str:
        text = self.transcribe(self.clips[1][0])
        wer = speech.word_error_rate([self.clips[1][1]], [text])
        if wer >= WER_LIMIT:
            raise CheckFailed(f"WER {wer:.3f} after the bad inputs: {text!r}")
        answer = self.chat([test_image(5), test_image(6)])
        return f"transcription {text!r}, chat {answer!r}"

    def run_hard_inputs(self) -> None:
        """The shared catalogue of hard inputs (mmcpu_dev.hard_inputs), through the gateway, one check per case."""
        try:
            from mmcpu_dev import hard_inputs
        except ImportError:
            return
        base_url = str(self.client.base_url).rstrip("/")
        api_key = self.client.api_key
        models = {"audio": self.audio_model, "vision": self.vision_model}
        for result in hard_inputs.run_all(base_url, api_key, models=models):
            self.check(f"hard-{result.case.name}", lambda r=result: _hard_result(r))

    def run(self) -> bool:
        bad_png = "data:image/png;base64,@@@not-base64@@@"
        non_audio = b"this is not audio at all, just text pretending to be a wav file" * 20
        self.check("models", self.models_listed)
        self.check("audio-and-vision-together", self.both_at_once)
        self.check("transcription-json-wer", self.transcription_json)
        self.check("transcription-text", self.transcription_text)
        self.check("transcription-srt", self.transcription_subtitles("srt"))
        self.check("transcription-vtt", self.transcription_subtitles("vtt"))
        self.check("vision-two-images", self.vision_two_images)
        self.check("chat-default-sampling", self.chat_default_sampling)
        self.check("transcription-temperature-0.4", self.transcription_sampled)
        self.check("bad-empty-file", self.bad(lambda: self.transcribe(b"")))
        self.check("bad-non-audio-bytes", self.bad(lambda: self.transcribe(non_audio)))
        self.check("bad-malformed-data-url", self.bad(lambda: self.chat([bad_png, test_image(1)])))
        self.check(
            "bad-non-image-bytes",
            self.bad(
                lambda: self.chat(["data:image/png;base64," + base64.b64encode(b"plain text, not a PNG" * 10).decode()])
            ),
        )
        self.check("bad-unknown-model-chat", self.bad(lambda: self.chat([test_image(1)], model="no-such-model"), {404}))
        self.check(
            "bad-unknown-model-audio", self.bad(lambda: self.transcribe(self.clips[0][0], model="no-such-model"), {404})
        )
        self.check("still-serving-after-bad-inputs", self.still_serving)
        self.run_hard_inputs()
        passed = sum(self.results)
        print(f"[smoke] {passed}/{len(self.results)} checks passed", flush=True)
        return passed == len(self.results)


def _hard_result(result) -> str:
    if not result.ok:
        raise CheckFailed(f"{result.case.endpoint} -> {result.status}: {result.detail}")
    return f"{result.status}: {result.detail[:100]}"


# --- fault-test modes ------------------------------------------------------------------------------
LOAD_RECORD = "[load] "
LOAD_SUMMARY = "[load-summary] "


def read_load(output: str) -> tuple[list[dict], dict | None]:
    """The per-request records and the summary (None until printed) in a ``--load`` run's output; a line still
    being written (the run goes on) is skipped."""
    records, summary = [], None
    for line in output.splitlines():
        for prefix in (LOAD_RECORD, LOAD_SUMMARY):
            if line.startswith(prefix):
                try:
                    value = json.loads(line[len(prefix) :])
                except ValueError:
                    continue
                if prefix == LOAD_RECORD:
                    records.append(value)
                else:
                    summary = value
    return records, summary


def seconds_at(values: list[float], q: float) -> float:
    """The q-th percentile of latencies as the summary prints it (the bench's definition; 0 for no values)."""
    found = percentile(values, q)
    return 0.0 if found is None else round(found, 2)


def run_load(
    smoke: Smoke, n: int, concurrency: int, duration_s: float | None = None, stop_file: Path | None = None
) -> bool:
    """n requests (fewer if duration_s runs out or stop_file appears first), alternating audio / vision, half of
    each with sampling options; concurrency at a time. Requests in flight when it stops are completed."""
    clips = smoke.clips
    print_lock = threading.Lock()

    def one(i: int) -> dict:
        kind = "audio" if i % 2 == 0 else "vision"
        sampling = i % 4 in (2, 3)
        t0 = time.time()
        record = {"i": i, "kind": kind, "sampling": sampling, "t0": round(t0, 3)}
        try:
            if kind == "audio":
                path, _ = clips[i // 2 % len(clips)]
                kwargs = transcription_kwargs(
                    path, model=smoke.audio_model, language="en", temperature=0.8 if sampling else 0.0
                )
                if sampling:
                    kwargs["extra_body"] = {"top_p": 0.9}
                text = smoke.client.audio.transcriptions.create(**kwargs).text
                if not text.strip():
                    raise CheckFailed("empty transcription")
            else:
                kwargs = image_chat_kwargs(
                    [test_image(i % 7 + 1), test_image(i % 5 + 11)],
                    model=smoke.vision_model,
                    temperature=0.8 if sampling else 0.0,
                    max_tokens=8,
                )
                if sampling:
                    kwargs["top_p"] = 0.9
                smoke.client.chat.completions.create(**kwargs)
            record["ok"] = True
        except openai.APIStatusError as exc:
            record.update(ok=False, error=f"HTTP {exc.status_code}: {exc.response.text[:150]}")
        except Exception as exc:
            record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:150]}")
        record["t1"] = round(time.time(), 3)
        with print_lock:  # one whole line per record: threads' prints must not interleave
            sys.stdout.write(f"{LOAD_RECORD}{json.dumps(record)}\n")
            sys.stdout.flush()
        return record

    t0 = time.monotonic()
    records: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(n))

    def go_on() -> bool:
        if duration_s is not None and time.monotonic() - t0 >= duration_s:
            return False
        return stop_file is None or not stop_file.exists()

    def worker() -> None:
        while go_on():
            with lock:
                i = next(counter, None)
            if i is None:
                return
            record = one(i)
            with lock:
                records.append(record)
            if not record["ok"]:
                time.sleep(1)  # like a client backing off: a down gateway must not eat the whole budget at once

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    n = len(records)
    wall = time.monotonic() - t0
    ok = [r for r in records if r["ok"]]
    lat = [r["t1"] - r["t0"] for r in ok]
    summary = {
        "requests": n,
        "concurrency": concurrency,
        "failures": n - len(ok),
        "wall_s": round(wall, 1),
        "p50_s": seconds_at(lat, 50),
        "p95_s": seconds_at(lat, 95),
    }
    for kind in ("audio", "vision"):
        for sampling in (False, True):
            part = [r for r in records if r["kind"] == kind and r["sampling"] == sampling]
            part_lat = [r["t1"] - r["t0"] for r in part if r["ok"]]
            label = f"{kind}{'-sampling' if sampling else ''}"
            summary[label] = {
                "n": len(part),
                "failures": sum(not r["ok"] for r in part),
                "p50_s": seconds_at(part_lat, 50),
                "p95_s": seconds_at(part_lat, 95),
            }
    print(f"{LOAD_SUMMARY}{json.dumps(summary)}", flush=True)
    return summary["failures"] == 0


def run_long(smoke: Smoke, seconds: float) -> bool:
    """One transcription of a clip about ``seconds`` long (the sentences again and again)."""
    words_per_s = 130 / 60
    text, i = [], 0
    while sum(len(t.split()) for t in text) < seconds * words_per_s:
        text.append(speech.SENTENCES[i % len(speech.SENTENCES)])
        i += 1
    path = speech.synthesize(" ".join(text), smoke.workdir / "long.wav")
    import soundfile

    duration = soundfile.info(str(path)).duration
    print(f"[long] sending a {duration:.1f} s clip", flush=True)
    t0 = time.monotonic()
    try:
        hyp = smoke.transcribe(path)
    except Exception as exc:
        print(f"[long] FAIL after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return False
    wer = speech.word_error_rate([" ".join(text)], [hyp])
    ok = wer < 0.5
    print(
        f"[long] {'PASS' if ok else 'FAIL'} after {time.monotonic() - t0:.1f}s: WER {wer:.3f}, "
        f"{len(hyp.split())} words: {hyp[:120]!r}",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url", default=f"http://127.0.0.1:{settings.gateway_port}/v1", help="default: %(default)s"
    )
    parser.add_argument("--audio-model", default=served_name(settings.audio_model), help="default: %(default)s")
    parser.add_argument("--vision-model", default=served_name(settings.vision_model), help="default: %(default)s")
    parser.add_argument("--timeout-s", type=float, default=300, help="per request (default: %(default)s)")
    parser.add_argument("--load", type=int, metavar="N", help="instead of the checks: a mixed load of N requests")
    parser.add_argument("--concurrency", type=int, default=8, help="of --load (default: %(default)s)")
    parser.add_argument("--duration-s", type=float, help="of --load: start no request after this long")
    parser.add_argument("--stop-file", type=Path, help="of --load: start no request once this file exists")
    parser.add_argument("--long-s", type=float, metavar="S", help="instead of the checks: one S-second transcription")
    args = parser.parse_args(argv)
    api_key = settings.api_key.get_secret_value() if settings.api_key else "unused"
    # max_retries=0: a failing request must show up as the failure it is, not be retried into something else.
    client = openai.OpenAI(base_url=args.base_url, api_key=api_key, max_retries=0, timeout=args.timeout_s)
    print(f"[smoke] {args.base_url}: audio model {args.audio_model}, vision model {args.vision_model}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmcpu-smoke-") as tmp:
        smoke = Smoke(client, args.audio_model, args.vision_model, Path(tmp))
        if args.load:
            ok = run_load(smoke, args.load, args.concurrency, args.duration_s, args.stop_file)
        elif args.long_s:
            ok = run_long(smoke, args.long_s)
        else:
            ok = smoke.run()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
