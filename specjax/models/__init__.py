"""Models and their checkpoints: the Llama-family target, the draft heads that ride beside it
(EAGLE-3, MTP), and their on-disk formats."""
from specjax.models.checkpoint_io import CheckpointError, read_safetensors
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from specjax.models.llama import Llama, dense_attention, rms_norm
from specjax.models.mtp_checkpoint import load_mtp_heads, save_mtp_heads
from specjax.models.mtp_head import MTPHeads, MTPModule

__all__ = ["CheckpointError", "Eagle3Head", "Eagle3HeadConfig", "Llama", "MTPHeads",
           "MTPModule", "ModelConfig", "RopeScaling", "dense_attention", "load_eagle3_head",
           "load_hf_checkpoint", "load_mtp_heads", "read_safetensors", "rms_norm",
           "save_eagle3_head", "save_hf_checkpoint", "save_mtp_heads"]
