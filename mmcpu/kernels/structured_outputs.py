"""Native ``vllm/.../structured_outputs.py``."""
