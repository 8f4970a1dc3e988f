"""mhf-dist: distributed training on Ray for hash-based generative language models."""

__version__ = "0.1.0"
