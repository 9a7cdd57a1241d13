"""eyas: EAGLE-3 speculative decoding for DeepSeek-V3-family models."""

from eyas.checkpoint import load_model

__all__ = ["load_model"]
__version__ = "0.1.0"
