"""The compose smoke check: ``python -m mmcpu.smoke [--base-url http://gateway:8000/v1]``.

Talks to the gateway the way a user does, with the unmodified ``openai`` client and the project's request
builders (mmcpu.payloads) and speech (mmcpu.speech):
  - transcriptions of espeak-ng sentences: WER over all of them, and the json / text / srt / vtt formats,
    each checked for being well formed and saying the same words;
  - image chats with two different images in one request; other images must give another answer;
  - one transcription and one two-image chat at the same time;
  - bad inputs (empty file, non-audio bytes, malformed data URL, unknown model) must get 4xx OpenAI-style
    errors, and a good request must still succeed afterwards.
One line per check; exit 0 only if every check passes. MRV2 evidence is in the engines' logs, which this
container cannot see: ``make e2e`` checks them after the smoke has passed.
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from mmcpu import speech
from mmcpu.checks import CheckFailed, expect_client_error, subtitle_text
from mmcpu.config import get_settings
from mmcpu.launch import served_name
from mmcpu.payloads import image_chat_kwargs, test_image, transcription_kwargs

WER_LIMIT = 0.35
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
        except Exception as exc:  # noqa: BLE001 - every failure becomes one FAIL line, the run goes on
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
            **transcription_kwargs(audio, model=model or self.audio_model, language="en", response_format=response_format)
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
        self.check("bad-empty-file", self.bad(lambda: self.transcribe(b"")))
        self.check("bad-non-audio-bytes", self.bad(lambda: self.transcribe(non_audio)))
        self.check("bad-malformed-data-url", self.bad(lambda: self.chat([bad_png, test_image(1)])))
        self.check("bad-non-image-bytes", self.bad(lambda: self.chat(
            ["data:image/png;base64," + base64.b64encode(b"plain text, not a PNG" * 10).decode()])))
        self.check("bad-unknown-model-chat", self.bad(lambda: self.chat([test_image(1)], model="no-such-model"), {404}))
        self.check("bad-unknown-model-audio", self.bad(
            lambda: self.transcribe(self.clips[0][0], model="no-such-model"), {404}))
        self.check("still-serving-after-bad-inputs", self.still_serving)
        passed = sum(self.results)
        print(f"[smoke] {passed}/{len(self.results)} checks passed", flush=True)
        return passed == len(self.results)


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m mmcpu.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=f"http://127.0.0.1:{settings.port}/v1", help="default: %(default)s")
    parser.add_argument("--audio-model", default=served_name(settings.audio_model), help="default: %(default)s")
    parser.add_argument("--vision-model", default=served_name(settings.vision_model), help="default: %(default)s")
    parser.add_argument("--timeout-s", type=float, default=300, help="per request (default: %(default)s)")
    args = parser.parse_args(argv)
    api_key = settings.api_key.get_secret_value() if settings.api_key else "unused"
    # max_retries=0: a failing request must show up as the failure it is, not be retried into something else.
    client = openai.OpenAI(base_url=args.base_url, api_key=api_key, max_retries=0, timeout=args.timeout_s)
    print(f"[smoke] {args.base_url}: audio model {args.audio_model}, vision model {args.vision_model}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmcpu-smoke-") as tmp:
        ok = Smoke(client, args.audio_model, args.vision_model, Path(tmp)).run()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
