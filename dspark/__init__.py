"""dspark: exact speculative decoding with the DSpark drafter for DeepSeek-V4 targets."""

from dspark.api import init_model, load_model
from dspark.draft import load_drafter
from dspark.generate import generate
from dspark.request import GenerationOutput, GenerationStats
from dspark.sampling import SamplingParams

__all__ = ["GenerationOutput", "GenerationStats", "SamplingParams", "generate", "init_model", "load_drafter",
           "load_model"]
__version__ = "0.1.0"
