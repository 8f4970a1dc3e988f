"""Evaluation: exact likelihood metrics over the real vocabulary."""

TASKS = ("ppl", "bpb", "lambada", "hellaswag", "card660", "recall")  # `mhf eval --task`
WINDOWED = ("ppl", "bpb")  # the tasks that score a text file in windows of `--seq-len` (`seq_len:`)
WINDOW = 128  # their default window: tokens per scored window
LAYER = -2  # card660: the hidden state whose mean is a word's vector (`mhf eval --layer`)
