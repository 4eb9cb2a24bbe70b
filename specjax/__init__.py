"""specjax: speculative decoding for LLMs in JAX/XLA.

Data flow: `LLM` (request API) -> `engine.Engine` (host loop: slots, KV blocks, batching) ->
`engine.step` (one pure jitted step) -> `pallas_kernels` (kernels + jnp references) -> results.
"""
from specjax.engine.engine import Engine, EngineConfig
from specjax.engine.request import RequestOutput, RequestStats
from specjax.llm import LLM
from specjax.sampling_params import SamplingParams
from specjax.speculative.config import (DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                                        SaveHiddenStatesConfig, SpeculativeConfig,
                                        UserProvidedConfig)
from specjax.speculative.eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from specjax.speculative.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.speculative.mtp_head import MTPHeads
from specjax.speculative.drafters import Drafter, NGramDrafter
from specjax.speculative.factory import get_spec_drafter, get_spec_worker, load_draft_model
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.schedule import SpeculationGate, get_draft_len_for_batch_size

__all__ = ["DraftTargetConfig", "Drafter", "Eagle3Head", "Eagle3HeadConfig", "EagleConfig",
           "Engine", "EngineConfig", "LLM", "MTPConfig", "MTPHeads", "NGramConfig",
           "NGramDrafter", "RequestOutput", "RequestStats", "SamplingParams",
           "SaveHiddenStatesConfig", "SpeculationGate", "SpeculativeConfig",
           "SpeculativeDecodingMode", "UserProvidedConfig", "get_draft_len_for_batch_size",
           "get_spec_drafter", "get_spec_worker", "load_draft_model", "load_eagle3_head",
           "save_eagle3_head"]
