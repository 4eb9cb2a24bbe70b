"""Host drafters: NGram, and any `Drafter` a user brings (USER_PROVIDED); the suffix automaton
that defines SA drafting."""
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.drafters.ngram import NGramDrafter
from specjax.speculative.drafters.suffix_automaton import SuffixAutomaton

__all__ = ["Drafter", "NGramDrafter", "SuffixAutomaton"]
