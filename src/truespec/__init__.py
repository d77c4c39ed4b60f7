"""truespec: fast speculative decoding that is exactly lossless."""

from truespec.llm import LLM
from truespec.outputs import CompletionOutput, RequestOutput
from truespec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
