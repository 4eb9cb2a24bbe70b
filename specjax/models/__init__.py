"""Target models: configuration, the Llama-family decoder, and Hugging Face checkpoint I/O."""
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.hf_checkpoint import (CheckpointError, load_hf_checkpoint, read_safetensors,
                                          save_hf_checkpoint)
from specjax.models.llama import Llama, dense_attention, rms_norm

__all__ = ["CheckpointError", "Llama", "ModelConfig", "RopeScaling", "dense_attention",
           "load_hf_checkpoint", "read_safetensors", "rms_norm", "save_hf_checkpoint"]
