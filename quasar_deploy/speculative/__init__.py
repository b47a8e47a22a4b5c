"""Speculative decoding: drafters propose, the verifier checks k+1 positions in one forward, acceptance keeps it lossless."""

from .acceptance import Sampler, SamplingParams, Verdict, accept
from .draft_model import ModelDrafter, check_same_vocabulary
from .drafters import Draft, Drafter, NoDrafter
from .layerskip import LayerSkipDrafter, choose_skip_layers
from .loop import LoopStats, speculate
from .ngram import NgramDrafter

__all__ = [
    "Draft",
    "Drafter",
    "LayerSkipDrafter",
    "LoopStats",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "Sampler",
    "SamplingParams",
    "Verdict",
    "accept",
    "check_same_vocabulary",
    "choose_skip_layers",
    "speculate",
]
