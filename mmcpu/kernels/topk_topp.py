"""Native ``vllm/.../topk_topp.py``."""
