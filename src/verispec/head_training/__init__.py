"""Trained draft heads: the training pipelines (`verispec train-heads`)."""
