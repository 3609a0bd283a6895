"""Native ``vllm/.../sample/prompt_logprob.py``."""
