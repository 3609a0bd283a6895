"""Native ``vllm/.../cp_utils.py``."""
