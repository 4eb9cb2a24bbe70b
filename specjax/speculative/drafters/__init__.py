"""Host drafters: NGram, and any `Drafter` a user brings (USER_PROVIDED)."""
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.drafters.ngram import NGramDrafter

__all__ = ["Drafter", "NGramDrafter"]
