"""eyas: EAGLE-3 speculative decoding for DeepSeek-V3-family models."""

from eyas.checkpoint import load_model
from eyas.config import SpeculativeConfig
from eyas.engine.llm import LLM, RequestOutput
from eyas.sampling_params import SamplingParams, StructuredOutputParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "StructuredOutputParams", "load_model"]
__version__ = "0.1.0"
