"""Native ``vllm/.../sample/bad_words.py``."""
