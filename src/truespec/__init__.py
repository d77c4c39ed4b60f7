"""truespec: fast speculative decoding that is exactly lossless."""

from truespec.llm import LLM
from truespec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from truespec.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
