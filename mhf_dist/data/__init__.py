"""Corpora, tokenizers and packing of token streams into training rows."""
