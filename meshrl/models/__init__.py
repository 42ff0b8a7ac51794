"""Model provisioning: the packaged SmolLM2 GGUF, its HF conversion, and the tiny test model."""
