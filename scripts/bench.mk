# Benchmarks (issue 5); included by the top Makefile (`-include scripts/bench.mk`).
#   make bench-venv   .cache/bench-venv from requirements-bench.txt (faster-whisper, matplotlib, py-spy),
#                     apart from the runtime venv so its pins stay untouched
#   make bench        scripts/bench.py: MRV2 vs V1 vs faster-whisper int8/float32, vision, the 100-request mixed
#                     load; writes docs/benchmarks.md, docs/bench/results.json, docs/bench/throughput.png.
#                     BENCH_ARGS="--base-url http://127.0.0.1:8000" measures a running compose stack instead.
BENCH_VENV   ?= .cache/bench-venv
BENCH_PYTHON ?= python3
BENCH_ARGS   ?=

.PHONY: bench bench-venv
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: requirements-bench.txt
	$(BENCH_PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-bench.txt
	touch $@

bench: models bench-venv
	$(PY) scripts/bench.py --bench-venv $(BENCH_VENV) $(BENCH_ARGS)
