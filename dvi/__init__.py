"""dvi: speculative decoding whose drafter keeps learning from the verifier's feedback."""

from dvi.drafters.learned import Drafter, EarlyExitDrafter, SeparateDrafter
from dvi.engine.speculative import GenerationResult, Request, SamplingParams, SpeculativeEngine, StepOutput

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
