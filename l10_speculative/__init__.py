"""L10: speculative decoding: drafters propose, the target verifies in one forward, the cache rewinds."""

from .acceptance import accept_greedy, accept_sampled, next_k
from .drafters import DraftModelDrafter, PromptLookupDrafter, propose_ngram
from .engine import SpecCounters, SpecEngine, SpecRequest, SpecScheduler, VerifyRunner, make_spec_engine
from .rewind import rewind

__all__ = [
    "accept_greedy", "accept_sampled", "next_k", "DraftModelDrafter", "PromptLookupDrafter", "propose_ngram",
    "SpecCounters", "SpecEngine", "SpecRequest", "SpecScheduler", "VerifyRunner", "make_spec_engine", "rewind",
]
