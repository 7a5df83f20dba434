"""Distillation of a tiny draft from the target (DistillSpec): data, model, training."""
