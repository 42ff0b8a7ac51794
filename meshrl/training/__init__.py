"""The learner's compute: an HF policy with optional LoRA, micro-batched forward/backward, AdamW."""
