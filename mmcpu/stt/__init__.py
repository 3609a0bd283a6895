"""OpenAI's speech API (POST /v1/audio/transcriptions and /translations) as a package of mmcpu's own.

Served through vLLM's official ``vllm.endpoint_plugins`` hook (:mod:`mmcpu.stt.plugin`, entry point ``mmcpu_stt``)
and built by composition on vLLM's public pieces: the ``EngineClient`` (``generate`` / ``abort``, and
``collective_rpc`` for the alignment forward of :mod:`mmcpu.whisper_align`), the model class's prompt builder
(``get_generation_prompt``), vLLM's audio loading and window splitting, and its request model. It overrides none
of vLLM's serving methods.

It is switched on by ``MMCPU_STT_ROUTES=plugin`` and serves the subset listed in :data:`mmcpu.stt.serving.COVERED`;
every other request goes, unchanged, to vLLM's own serving object, which the plugin keeps from ``init_state``
(:meth:`mmcpu.stt.serving.SpeechServing.delegation`).
"""

PLUGIN_NAME = "mmcpu_stt"
# The response header naming who answered: "plugin", or "vllm; reason=<why the package handed it on>".
ROUTE_HEADER = "mmcpu-stt-route"
