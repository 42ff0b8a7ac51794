"""meshrl: agentic RL post-training of language models on Monarch actor meshes."""

__version__ = "0.1.0"
