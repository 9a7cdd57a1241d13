"""eyas: EAGLE-3 speculative decoding for DeepSeek-V3-family models."""

from eyas.checkpoint import load_model
from eyas.config import SamplingParams, SpeculativeConfig, StructuredOutputParams
from eyas.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StructuredOutputParams", "load_model"]
__version__ = "0.1.0"
