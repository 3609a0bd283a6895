"""Native ``vllm/.../block_table.py``."""
