"""Native ``vllm/.../utils.py``."""
