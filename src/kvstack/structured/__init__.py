"""Structured outputs: constraints on a request's output (JSON schema, regex, choice, grammar)
compiled by llguidance into per-request matchers that mask the sampler's logits each step.

`grammars.py` turns a `StructuredOutputsParams` into llguidance's grammar text and checks it;
`guides.py` holds the per-request matcher (a `TokenGuide` the sampler applies) and computes a
step's masks in the background while the model runs.
"""

from kvstack.structured.grammars import Grammar, StructuredOutputsUnavailableError, compile_grammar
from kvstack.structured.guides import Guide, StructuredBackend

__all__ = ["Grammar", "Guide", "StructuredBackend", "StructuredOutputsUnavailableError",
           "compile_grammar"]
