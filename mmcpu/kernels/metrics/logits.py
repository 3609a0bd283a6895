"""Native ``vllm/.../metrics/logits.py``."""
