"""Native ``vllm/.../mm/rope.py``."""
