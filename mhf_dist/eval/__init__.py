"""Evaluation: exact likelihood metrics over the real vocabulary."""
