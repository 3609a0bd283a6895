"""Native kernels mirroring vLLM's v1/worker/gpu/model_states/."""
