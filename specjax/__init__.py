"""specjax: speculative decoding for LLMs in JAX/XLA.

Data flow, one way: `LLM` (request API) -> `engine.Engine` (host loop: scheduler, executor,
bookkeeper, output processor) -> `speculative` (modes, configs, drafters, workers) -> `core`
(the jitted steps: the public step API) -> `models`, `pallas_kernels` -> results.
See ARCHITECTURE.md for where each mechanism lives.
"""
from specjax import xla_flags

xla_flags.apply()  # before anything starts JAX's backend

from specjax.engine.engine import Engine, EngineConfig
from specjax.engine.request import RequestOutput, RequestStats
from specjax.llm import LLM
from specjax.models import (DFlashHead, DSparkHead, Eagle3Head, Eagle3HeadConfig, MTPHeads,
                            load_dflash_head, load_eagle3_head, save_dflash_head,
                            save_eagle3_head, save_pard_model)
from specjax.sampling_params import SamplingParams
from specjax.speculative.build import (Speculation, build_speculation, get_spec_drafter,
                                       get_spec_worker, load_draft_model)
from specjax.speculative.config import (AutoConfig, DFlashConfig, DraftTargetConfig, DSparkConfig,
                                        EagleConfig,
                                        MTPConfig, NGramConfig, PARDConfig, SAConfig,
                                        SAEnhancerConfig, SaveHiddenStatesConfig,
                                        SpeculativeConfig, UserProvidedConfig)
from specjax.speculative.drafters import Drafter, NGramDrafter, SuffixAutomaton
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.schedule import SpeculationGate, get_draft_len_for_batch_size

__all__ = ["AutoConfig", "DFlashConfig", "DFlashHead", "DSparkConfig", "DSparkHead",
           "DraftTargetConfig", "Drafter", "Eagle3Head",
           "Eagle3HeadConfig", "EagleConfig", "Engine", "EngineConfig", "LLM", "MTPConfig",
           "MTPHeads", "NGramConfig", "NGramDrafter", "PARDConfig", "RequestOutput",
           "RequestStats", "SAConfig", "SAEnhancerConfig", "SamplingParams",
           "SaveHiddenStatesConfig", "Speculation", "SpeculationGate", "SpeculativeConfig",
           "SpeculativeDecodingMode", "SuffixAutomaton", "UserProvidedConfig", "build_speculation",
           "get_draft_len_for_batch_size", "get_spec_drafter", "get_spec_worker",
           "load_dflash_head", "load_draft_model", "load_eagle3_head", "save_dflash_head",
           "save_eagle3_head", "save_pard_model"]
