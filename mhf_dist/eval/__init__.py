"""Evaluation: exact likelihood metrics over the real vocabulary."""

TASKS = ("ppl", "bpb", "lambada", "hellaswag", "card660", "recall")  # `mhf eval --task`
WINDOW = 128  # ppl and bpb of a text file: tokens per scored window (`mhf eval --seq-len`)
LAYER = -2  # card660: the hidden state whose mean is a word's vector (`mhf eval --layer`)
