# Benchmarks; included by the top Makefile (`-include scripts/bench.mk`).
#   make bench-venv   .cache/bench-venv from requirements-bench.txt (faster-whisper, matplotlib, py-spy),
#                     apart from the runtime venv so its pins stay untouched
#   make bench        scripts/bench.py: MRV2 native vs MRV2 interpreter vs V1 vs faster-whisper int8/float32,
#                     each vLLM configuration alone; vision; a mixed load through the gateway. Writes
#                     docs/benchmarks.md, docs/bench/results.json (its "headline" object), docs/bench/throughput.png
#   make bench-quick  the same in a few minutes (c=1,4, one round each, no interpreter), for development;
#                     writes to .cache/bench-quick so the committed report is not overwritten
BENCH_VENV   ?= .cache/bench-venv
BENCH_PYTHON ?= python3
BENCH_ARGS   ?=

.PHONY: bench bench-quick bench-venv
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: requirements-bench.txt
	$(BENCH_PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-bench.txt
	touch $@

bench: models bench-venv
	$(PY) scripts/bench.py --bench-venv $(BENCH_VENV) $(BENCH_ARGS)

bench-quick: models bench-venv
	$(PY) scripts/bench.py --bench-venv $(BENCH_VENV) --quick --out .cache/bench-quick $(BENCH_ARGS)
