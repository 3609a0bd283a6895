"""Reference deployment of vLLM Model Runner V2 multimodal (audio + vision) on CPU."""
