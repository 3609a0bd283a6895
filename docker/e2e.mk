# Docker image, compose stack and the containerised end-to-end proof; included by the top Makefile.
#   make image            patched runtime image $(IMAGE) (BuildKit; starts an engine / seeds the base if needed)
#   make image-unpatched  the same without the three upstream seed patches: $(IMAGE_UNPATCHED)
#   make image-smoke      the compose smoke client $(IMAGE_SMOKE)
#   make images           engine + base image, then the three images, each only when missing or stale (what
#                         make e2e does first; CI runs it beside make test)
#   make e2e              bash (scripts/docker-e2e images): engine + base image, all three images; then pytest
#                         (tests/e2e, marker e2e): no CA in any layer, runtime non-root and without compilers, then
#                         compose.yaml + compose.test.yaml: the patched stack must pass the smoke, heal from the
#                         fault tests (EngineCore hung by SIGSTOP or killed, container killed, gateway restart,
#                         drained stop), a mixed load and log MRV2; the unpatched one must fail with the known
#                         error. Prints image size, build time, ready time, RSS per service, the faults' detection
#                         and recovery times (.cache/logs/e2e/figures.txt), also when a test failed.
#                         E2E_PYTEST_ARGS: more pytest arguments (e.g. -k hang); E2E_* knobs: tests/e2e/__init__.py
#   make up               the stack to leave running: engine, base image and image only when missing or stale
#                         (label io.mmcpu.inputs-hash), compose.yaml up -d, waits for health, prints the URL
#   make down             stops it (the cache volume stays)
#   make docker-engine-stop   stop a dockerd that scripts/docker-engine started
# TORCH_INDEX_URL: the PyTorch CPU index by default (the line's +cpu torch, ~3 GB smaller image), the same default as
# docker/Dockerfile (and so `docker compose build`); where it does not answer the build says so in one line and
# uses PyPI's torch. Empty = PyPI outright.
IMAGE           ?= mmcpu:latest
IMAGE_UNPATCHED ?= mmcpu:unpatched
IMAGE_SMOKE     ?= mmcpu:smoke
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
CA_BUNDLE       ?= /etc/ssl/certs/ca-certificates.crt
E2E_ENV = IMAGE=$(IMAGE) IMAGE_UNPATCHED=$(IMAGE_UNPATCHED) IMAGE_SMOKE=$(IMAGE_SMOKE) \
          TORCH_INDEX_URL=$(TORCH_INDEX_URL) VLLM_VERSION=$(VLLM_VERSION) CA_BUNDLE=$(CA_BUNDLE)
E2E_PYTEST_ARGS ?=
# Progress lines live: the stacks take minutes, and a quiet terminal looks hung.
E2E_PYTEST = $(PY) -m pytest tests/e2e -m e2e -v -o log_cli=true --log-cli-level=INFO \
             --log-cli-format='[e2e %(asctime)s] %(message)s' --log-cli-date-format=%H:%M:%S

.PHONY: docker-prepare image image-unpatched image-smoke images e2e up down docker-engine-stop
docker-prepare:
	scripts/docker-e2e prepare

image: docker-prepare
	$(E2E_ENV) scripts/docker-e2e build patched

image-unpatched: docker-prepare
	$(E2E_ENV) scripts/docker-e2e build unpatched

image-smoke: docker-prepare
	$(E2E_ENV) scripts/docker-e2e build smoke

images:
	$(E2E_ENV) scripts/docker-e2e images

# One shell: the figures are printed (with the total) whatever the tests' result, which is make's.
e2e:
	@test -x $(PY) || { echo "make e2e runs its tests with $(PY): make venv first"; exit 1; }
	@t0=$$(date +%s); rc=0; \
	$(E2E_ENV) scripts/docker-e2e images && $(E2E_ENV) $(E2E_PYTEST) $(E2E_PYTEST_ARGS) || rc=$$?; \
	scripts/docker-e2e figures "$$t0"; exit $$rc

up:
	$(E2E_ENV) scripts/docker-e2e up

down:
	scripts/docker-e2e down

docker-engine-stop:
	scripts/docker-engine stop
