"""verispec: exact (lossless) speculative decoding.

A drafter proposes K tokens (or a tree of candidates), the target scores them in one pass, and
speculative sampling (Leviathan et al. 2023; SpecInfer and recursive rejection sampling for trees)
keeps the output distribution exactly the target's.
"""

from verispec.api import GenerationResult, SpeculativeDecoder, generate
from verispec.config import PromptLookupConfig, SamplingConfig, SpecConfig, TreeConfig
from verispec.core.sequence import StepEvent
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "PromptLookupConfig",
    "SamplingConfig",
    "SpecConfig",
    "SpeculativeDecoder",
    "SpeculativeEngine",
    "StepEvent",
    "TreeConfig",
    "VerispecError",
    "generate",
]
