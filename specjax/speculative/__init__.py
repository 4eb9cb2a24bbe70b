"""Speculation: modes and their predicates, configs, the draft-length schedule and the gate,
host drafters (`drafters/`), in-step workers (`workers/`), and `build_speculation`, which turns
a config into what the engine runs."""
from specjax.speculative.drafters.suffix_automaton import SuffixAutomaton

__all__ = ["SuffixAutomaton"]
