"""The torch.compile backend: partition-time rewrites, the pass pipeline, scheduling, cost model and checks."""
