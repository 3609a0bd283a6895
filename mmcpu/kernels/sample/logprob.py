"""Native ``vllm/.../sample/logprob.py``."""
