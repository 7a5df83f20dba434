"""Model loading (named defaults, HF directories, GGUF) and the ragged KV-cache runner."""

from verispec.models.loading import LoadedModel, check_same_tokenizer, load_model
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, NAMED_MODELS
from verispec.models.runners.hf import KVState, ModelRunner

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "NAMED_MODELS",
    "KVState",
    "LoadedModel",
    "ModelRunner",
    "check_same_tokenizer",
    "load_model",
]
