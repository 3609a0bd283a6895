"""Native ``vllm/.../buffer_utils.py``."""
