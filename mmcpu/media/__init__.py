"""What a request may make an engine fetch and decode: the media-URL policy and the size limits checked before
decoding (docs/security.md).

- :mod:`mmcpu.media.policy`: which URLs may be fetched (``data:`` only unless MMCPU_MEDIA_DOMAINS lists hosts) and
  which addresses may be connected to (public unicast only, checked on the address actually connected to).
- :mod:`mmcpu.media.limits`: encoded bytes per item (MMCPU_MAX_MEDIA_MB) and pixels per image, frames included
  (MMCPU_MAX_IMAGE_PIXELS), read from the container's header before anything is decoded.
- :mod:`mmcpu.media.connector`: vLLM's media connector with both, registered as ``mmcpu`` in vLLM's
  ``MEDIA_CONNECTOR_REGISTRY`` by the general plugin (mmcpu/plugin.py) and selected by ``VLLM_MEDIA_CONNECTOR``,
  which the launcher sets for every engine.
"""

# The one answer to every failed fetch (no connection detail: an open port reads like a closed one). Here, apart from
# the connector, so clients and tests can compare with it without importing vLLM.
FETCH_FAILED = (
    "Could not load media from this URL. This server loads data: URLs, and http(s) URLs only from the "
    "hosts its operator allows (MMCPU_MEDIA_DOMAINS) when they answer in time with a supported file."
)
