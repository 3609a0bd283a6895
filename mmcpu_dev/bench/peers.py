"""The peers' setup, cached and idempotent: each peer's venv under ``CACHE/peers/NAME`` (pins in
``peer-requirements/``), and the weights it loads converted from the same HF checkpoint our engine loads.

- OpenVINO GenAI: ``optimum-cli export openvino --task automatic-speech-recognition-with-past`` (without
  ``-with-past`` the pipeline refuses the IR: "Port for tensor name beam_idx was not found") in the export venv,
  ``--weight-format fp32`` and ``int8``; the pipeline runs in its own venv.
- whisper.cpp: pywhispercpp built from its sdist for this CPU (GGML_NATIVE, without ggml's AMX backend), the
  library's rpath set to its own folder (else "libwhisper.so.1: cannot open shared object file"); ggml f16 by
  whisper.cpp's converter (shipped in that sdist; run in the export venv, which has torch and transformers) with
  openai-whisper's mel filters, q8_0 by whisper.cpp's quantize tool built from the same sdist.

Every step writes a stamp (what it was built from) last; a step whose stamp matches is skipped, so a second
``make bench`` redoes nothing. A step that fails raises ``PeerUnavailable`` with the failing command and the last
lines of its output (the whole output: ``CACHE/logs/bench/peer-setup.log``); the benchmark reports it as such.
Builds and conversions run under ``nice -n 19``: the machine may be shared.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REQS = Path(__file__).with_name("peer-requirements")
STAMP = ".mmcpu-stamp.json"
NICE = ["nice", "-n", "19"]


class PeerUnavailable(RuntimeError):
    """A peer that cannot be set up here; the message is the exact error."""


def source_pin(name: str) -> str:
    """The pinned version of a source package in peer-requirements/sources.txt."""
    for ln in (REQS / "sources.txt").read_text().splitlines():
        req = ln.split("#", 1)[0].strip()
        if req.startswith(f"{name}=="):
            return req.split("==", 1)[1]
    raise KeyError(name)


def digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def stamped(folder: Path, key: str) -> bool:
    try:
        return json.loads((folder / STAMP).read_text())["key"] == key
    except (OSError, ValueError, KeyError):
        return False


def stamp(folder: Path, key: str, **info: object) -> None:
    (folder / STAMP).write_text(json.dumps({"key": key, **info}, indent=1, default=str) + "\n")


class Setup:
    """The peers' venvs and converted weights under ``cache/peers``; every command's output in one log."""

    def __init__(self, cache: Path, python: str = sys.executable, log: Path | None = None) -> None:
        self.root = cache / "peers"
        self.root.mkdir(parents=True, exist_ok=True)
        self.python = python  # builds the venvs (a base interpreter; its venv module)
        self.log_path = log or cache / "logs" / "bench" / "peer-setup.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.errors: dict[str, str] = {}  # step -> error, so a failed step is not retried for every system

    # --- commands ----------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        with self.log_path.open("a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            done = subprocess.run(
                [*NICE, *cmd],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
                cwd=cwd,
            )
            log.write(done.stdout)
        if done.returncode != 0:
            tail = [ln for ln in done.stdout.strip().splitlines() if ln.strip()][-4:]
            raise PeerUnavailable(
                f"`{' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}` exited "
                f"{done.returncode}: " + " | ".join(t.strip() for t in tail)
            )
        return done.stdout

    def step(self, name: str, fn):
        if name in self.errors:
            raise PeerUnavailable(self.errors[name])
        try:
            return fn()
        except PeerUnavailable as exc:
            self.errors[name] = str(exc)
            raise

    # --- venvs -------------------------------------------------------------------------------------------------
    def venv(self, name: str, reqs: str, then: list[list[str]] = (), env: dict[str, str] | None = None) -> Path:
        """CACHE/peers/NAME from peer-requirements/REQS, then the ``then`` commands ({py}: its python)."""
        folder = self.root / name
        py = folder / "bin" / "python"
        then = [list(c) for c in then]
        key = digest((REQS / reqs).read_text(), then, env)
        if stamped(folder, key) and py.is_file():
            return py

        def build() -> Path:
            shutil.rmtree(folder, ignore_errors=True)
            self.run([self.python, "-m", "venv", str(folder)])
            self.run([str(py), "-m", "pip", "install", "-q", "-r", str(REQS / reqs)])
            for cmd in then:
                self.run([str(py) if c == "{py}" else c for c in cmd], env=env)
            stamp(folder, key, requirements=reqs, then=then)
            return py

        return self.step(f"venv {name}", build)

    def export_venv(self) -> Path:
        # PyPI's torchvision (pulled in by a dependency) beside torch+cpu breaks transformers' imports
        return self.venv(
            "openvino-export",
            "openvino-export.txt",
            then=[["{py}", "-m", "pip", "uninstall", "-y", "-q", "torchvision"]],
        )

    def openvino_venv(self) -> Path:
        return self.venv("openvino", "openvino.txt")

    def sources(self, name: str) -> Path:
        """A source package's sdist (pip download, pinned in sources.txt), unpacked under CACHE/peers/src."""
        version = source_pin(name)
        out = self.root / "src" / f"{name}-{version}"
        key = digest(name, version)
        if stamped(out, key):
            return out

        def fetch() -> Path:
            dl = self.root / "src" / "dl"
            shutil.rmtree(dl, ignore_errors=True)
            self.run(
                [
                    self.python,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    name,
                    f"{name}=={version}",
                    "-d",
                    str(dl),
                ]
            )
            (sdist,) = [p for p in dl.iterdir() if p.name.endswith(".tar.gz")]
            shutil.rmtree(out, ignore_errors=True)
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            with tarfile.open(sdist) as tf:
                tf.extractall(tmp, filter="data")
            (top,) = list(tmp.iterdir())
            top.rename(out)
            shutil.move(str(sdist), out / sdist.name)
            shutil.rmtree(tmp)
            stamp(out, key, sdist=sdist.name)
            return out

        return self.step(f"sources {name}", fetch)

    def whispercpp_venv(self) -> Path:
        src = self.sources("pywhispercpp")
        (sdist,) = src.glob("pywhispercpp-*.tar.gz")
        # GGML_NATIVE: built for this CPU (AVX-512 where there is), but without ggml's AMX backend: on an AMX CPU
        # -march=native builds it, and its q8_0 matmul segfaults (ggml_backend_amx_mul_mat, llama.cpp #20824;
        # docs/bench/analysis.md). GCC's explicit -mno-amx-* win over -march=native in any order; elsewhere no-ops.
        # They go in CFLAGS/CXXFLAGS (CMake's initial flags): pywhispercpp splits CMAKE_ARGS on spaces.
        # The rpath: libwhisper.so.1 beside the module.
        cmake = "-DGGML_NATIVE=ON -DCMAKE_INSTALL_RPATH=$ORIGIN -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        env = {"CMAKE_ARGS": cmake, "CFLAGS": no_amx, "CXXFLAGS": no_amx, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        return self.venv(
            "whispercpp",
            "whispercpp.txt",
            env=env,
            then=[
                ["{py}", "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", str(sdist)],
                ["{py}", "-c", "import pywhispercpp.model"],
            ],
        )

    def whispercpp_quantize(self) -> Path:
        """whisper.cpp's quantize tool, built from the same sdist's whisper.cpp (static, for this CPU)."""
        src = self.sources("pywhispercpp") / "whisper.cpp"
        build = self.root / "whispercpp-tools"
        tool = build / "bin" / "whisper-quantize"
        key = digest(src.parent.name, "quantize")
        if stamped(build, key) and tool.is_file():
            return tool

        def make() -> Path:
            shutil.rmtree(build, ignore_errors=True)
            self.run(
                [
                    "cmake",
                    "-S",
                    str(src),
                    "-B",
                    str(build),
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON",
                    "-DBUILD_SHARED_LIBS=OFF",
                    "-DWHISPER_BUILD_EXAMPLES=ON",
                    "-DWHISPER_BUILD_TESTS=OFF",
                    "-DWHISPER_SDL2=OFF",
                    "-DWHISPER_CURL=OFF",
                ]
            )
            self.run(["cmake", "--build", str(build), "--target", "whisper-quantize", "-j", "2"])
            stamp(build, key)
            return tool

        return self.step("whisper.cpp quantize", make)

    def mel_filters_root(self) -> Path:
        """A folder with whisper/assets/mel_filters.npz (from openai-whisper's sdist), as the converter wants."""
        return self.sources("openai-whisper")

    # --- converted weights -------------------------------------------------------------------------------------
    def converted(self, name: str, checkpoint: Path, build, *tool: object) -> Path:
        """CACHE/peers/weights/NAME, built by ``build(tmp_folder)`` once per checkpoint and tool."""
        out = self.root / "weights" / name
        marker = checkpoint / "mmcpu-fixture.json"
        key = digest(marker.read_text() if marker.is_file() else checkpoint.stat().st_mtime, *tool)
        if stamped(out, key):
            return out

        def make() -> Path:
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            build(tmp)
            stamp(tmp, key, checkpoint=checkpoint, tool=tool)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            return out

        return self.step(f"weights {name}", make)

    def openvino_ir(self, checkpoint: Path, weights: str) -> Path:
        if not (checkpoint / "config.json").is_file():
            raise PeerUnavailable(f"{checkpoint} missing (run `make models`)")
        py = self.export_venv()
        cli = py.parent / "optimum-cli"
        cmd = [
            "export",
            "openvino",
            "--model",
            str(checkpoint),
            "--task",
            "automatic-speech-recognition-with-past",
            "--weight-format",
            weights,
        ]
        return self.converted(
            f"{checkpoint.name}-ov-{weights}",
            checkpoint,
            lambda tmp: self.run([str(cli), *cmd, str(tmp)], env={"HF_HUB_OFFLINE": "1"}),
            cmd,
            (REQS / "openvino-export.txt").read_text(),
        )

    def ggml(self, checkpoint: Path, weights: str) -> Path:
        """The ggml model file: f16 by whisper.cpp's converter, q8_0 quantised from it by its quantize tool."""
        if not (checkpoint / "config.json").is_file():
            raise PeerUnavailable(f"{checkpoint} missing (run `make models`)")
        src = self.sources("pywhispercpp") / "whisper.cpp"
        if weights == "f16":
            py, mel = self.export_venv(), self.mel_filters_root()
            converter = src / "models" / "convert-h5-to-ggml.py"

            def convert(tmp: Path) -> None:
                staging = tmp / "hf"
                vocab_files(checkpoint, staging)
                self.run([str(py), str(converter), str(staging), str(mel), str(tmp)], env={"HF_HUB_OFFLINE": "1"})
                shutil.rmtree(staging)

            folder = self.converted(f"{checkpoint.name}-ggml-f16", checkpoint, convert, src.parent.name)
            return folder / "ggml-model.bin"
        f16 = self.ggml(checkpoint, "f16")
        tool = self.whispercpp_quantize()
        folder = self.converted(
            f"{checkpoint.name}-ggml-{weights}",
            checkpoint,
            lambda tmp: self.run([str(tool), str(f16), str(tmp / "ggml-model.bin"), weights]),
            src.parent.name,
            weights,
        )
        return folder / "ggml-model.bin"

    # --- per system --------------------------------------------------------------------------------------------
    def prepare(self, engine: str, checkpoint: Path, weights: str) -> tuple[Path, Path]:
        """(the python of the peer's venv, the weights it loads) for an OpenVINO or whisper.cpp system."""
        if engine == "openvino":
            return self.openvino_venv(), self.openvino_ir(checkpoint, weights)
        if engine == "whisper.cpp":
            return self.whispercpp_venv(), self.ggml(checkpoint, weights)
        raise ValueError(engine)


def vocab_files(checkpoint: Path, out: Path) -> None:
    """A view of a HF Whisper checkpoint with the vocab.json and added_tokens.json whisper.cpp's converter reads
    (our fixtures carry only tokenizer.json): links to its files, the two JSONs derived from tokenizer.json."""
    out.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (out / f.name).symlink_to(f.resolve())
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    (out / "vocab.json").write_text(json.dumps(tok["model"]["vocab"], ensure_ascii=False))
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    (out / "added_tokens.json").write_text(json.dumps(added, ensure_ascii=False))
