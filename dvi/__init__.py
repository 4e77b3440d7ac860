"""dvi: speculative decoding whose drafter keeps learning from the verifier's feedback."""

from dvi.decode.engine import GenerationResult, Request, SamplingParams, SpeculativeEngine, StepOutput
from dvi.drafters.learned import Drafter, EarlyExitDrafter, SeparateDrafter

__all__ = [
    "Drafter",
    "EarlyExitDrafter",
    "GenerationResult",
    "Request",
    "SamplingParams",
    "SeparateDrafter",
    "SpeculativeEngine",
    "StepOutput",
]
__version__ = "0.1.0"
