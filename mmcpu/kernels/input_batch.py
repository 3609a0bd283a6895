"""Native ``vllm/.../input_batch.py``."""
