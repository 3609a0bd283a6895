"""Native ``vllm/.../sample/logit_bias.py``."""
