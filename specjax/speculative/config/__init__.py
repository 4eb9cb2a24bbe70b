"""Speculative decoding configs, one class per mode family. Importing this package registers
every config class, so `SpeculativeConfig.from_dict` / `from_json` know every stored mode."""
from specjax.speculative.config.base import SpeculativeConfig
from specjax.speculative.config.auto import AutoConfig
from specjax.speculative.config.enhancer import SAEnhancerConfig
from specjax.speculative.config.token_drafters import (DraftTargetConfig, NGramConfig, SAConfig,
                                                       UserProvidedConfig)
from specjax.speculative.config.heads import (EagleConfig, MTPConfig, SaveHiddenStatesConfig,
                                              default_eagle3_layers)
from specjax.speculative.config.parallel import DFlashConfig, DSparkConfig, PARDConfig

__all__ = ["AutoConfig", "DFlashConfig", "DSparkConfig", "DraftTargetConfig", "EagleConfig", "MTPConfig",
           "NGramConfig", "PARDConfig", "SAConfig", "SAEnhancerConfig", "SaveHiddenStatesConfig",
           "SpeculativeConfig", "UserProvidedConfig", "default_eagle3_layers"]
