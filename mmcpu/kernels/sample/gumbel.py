"""Native ``vllm/.../sample/gumbel.py``."""
