"""The numbers papers plot about speculative decoding, from runs of `specjax.LLM`: the benches
(`python -m specjax.bench`) and the notebooks use these same functions.

    with trace(llm) as t:                     # per-step acceptance records of a run
        outs = llm.generate(prompts, params)
    at_least(t.accepted_histogram(), D)       # AR_k = P(accepted >= k), k = 1..D
    predicted_al(alpha(ar), D)                # (1 - a^(D+1)) / (1 - a)
"""
from specjax.analysis.acceptance import (acceptance_length, al_by_depth, al_histogram, alpha,
                                         at_least, conditional_acceptance, output_acceptance,
                                         predicted_al)
from specjax.analysis.distribution import empirical, tvd, tvd_bound
from specjax.analysis.speed import (Speed, efficiency, measure, speed_vs_batch_size,
                                    step_times)
from specjax.analysis.trace import Trace, trace

__all__ = ["Speed", "Trace", "acceptance_length", "al_by_depth", "al_histogram", "alpha",
           "at_least", "conditional_acceptance", "efficiency", "measure", "output_acceptance",
           "predicted_al", "speed_vs_batch_size", "step_times", "trace", "empirical", "tvd", "tvd_bound"]
