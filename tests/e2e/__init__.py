"""The containerised end-to-end proof behind ``make e2e``: the images and the compose stacks, tested from the host.

``make e2e`` (docker/e2e.mk) first prepares the engine and builds the three images in bash
(``scripts/docker-e2e images``), then runs ``python -m pytest tests/e2e -m e2e``, then prints the figures. The
tests need a docker engine and those images, so ``make test`` / ``make test-quick`` never collect this directory
(``collect_ignore`` in tests/conftest.py); name it on the command line to run it:

    .cache/venv/bin/python -m pytest tests/e2e -m e2e -k hang        # one test, against images already built

  test_images.py           no layer of any image holds the build host's CA (and a leaking control image is
                           caught); the runtime runs as uid 10001 without compilers and refuses the settings that
                           need one; the patch tool works in the image without arguments; tini as PID 1 reaps
                           orphans (and without it they stay zombies); the SBOM lists exactly the runtime's Python
                           distributions and Debian packages, and no test-only package is among them
  test_patched_stack.py    compose.yaml + compose.test.yaml with the patched image, detached: the smoke client
                           (mmcpu_dev.smoke in its container) must pass; the fault tests (EngineCore hung by
                           SIGSTOP, EngineCore and container killed, gateway restart mid-load, `compose stop`
                           draining a long transcription); a mixed load with 0 failures; both engines log MRV2;
                           every service read-only, without capabilities, under tini with no zombie left; engines
                           reachable only from the gateway, with no way out; each service with its own keys only
  test_unpatched_stack.py  the same stack with the image without the seed patches must fail with the known error
                           (HTTP 500, "Found no NVIDIA driver on your system" under MRV2)

Env (the knobs of the bash version, same meaning):
  E2E_TIMEOUT_S   a stack's start, and the smoke / load runs (default 2400)
  E2E_RESTART_S   an engine's way back after a fault: restart or ``compose start`` (default 1200)
  E2E_FAULTS      1 (default): the fault tests; 0 skips them
  E2E_LOAD_N      requests of the mixed load (default 100)
  E2E_LONG_S      the clip the audio engine drains across ``compose stop`` (default 720 s of words:
                  a ~565 s clip, under vLLM's 600 s limit)
  IMAGE, IMAGE_UNPATCHED, IMAGE_SMOKE   the tags (default mmcpu:latest, mmcpu:unpatched, mmcpu:smoke)
  MMCPU_PROJECT   prefix of the stacks' compose projects (default mmcpu: mmcpu-e2e-patched, mmcpu-e2e-unpatched)
  MMCPU_API_KEY, MMCPU_ENGINE_API_KEY   the stacks' client and internal keys (default: made up per run)
  DOCKER          the client (default /usr/bin/docker); ``docker compose`` v2 when it has it, else docker-compose
  CA_BUNDLE       the bundle the secrets scan looks for (default /etc/ssl/certs/ca-certificates.crt)
  MMCPU_AUDIO_MODEL, MMCPU_VISION_MODEL, MMCPU_STOP_GRACE   as the stack gets them
Logs: .cache/logs/e2e/ (e2e.log has the progress lines); figures are appended to .cache/logs/e2e/figures.txt,
which ``scripts/docker-e2e images`` starts afresh.
"""
