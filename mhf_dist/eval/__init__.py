"""Evaluation: exact likelihood metrics over the real vocabulary."""

TASKS = ("ppl", "bpb", "lambada", "hellaswag", "card660", "recall")  # `mhf eval --task`
