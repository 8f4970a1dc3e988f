"""Training: one step loop shared by local runs and Ray Train workers."""
