"""OpenAI-compatible gateway in front of the vLLM engines (see docs/gateway.md).

Entry points: ``mmcpu.gateway.app.create_app(settings)`` and ``mmcpu.gateway.app.main`` (also ``python -m
mmcpu.gateway``). Nothing is imported here, so ``python -m mmcpu.gateway.app`` runs without a runpy warning.
"""
