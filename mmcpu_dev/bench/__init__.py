"""The benchmark, one package: ``python -m mmcpu_dev.bench {full,quick,latency,render}`` (``make bench``,
``make bench-quick``, ``make latency``).

- ``plan``: the fixed workload, the systems (which one is ours: the audio role's default) and the headline figures;
- ``inputs``: the workload's speech clips, long files and the CTranslate2 weights for faster-whisper;
- ``runners``: vLLM engines (``mmcpu_dev.servers.Engine``), faster-whisper (``peer.py`` in the bench venv), the
  gateway, timed rounds, load and memory records, py-spy;
- ``run``: the modes; ``stats``, ``profiles``: arithmetic; ``results``: the typed results and the headline;
  ``report``: docs/benchmarks.md; ``peer``: what runs in the bench venv (faster-whisper, the plot).
"""
