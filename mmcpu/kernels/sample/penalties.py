"""Native ``vllm/.../sample/penalties.py``."""
