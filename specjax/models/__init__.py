"""Models and their checkpoints: the Llama-family target (and Bamba, a hybrid one), the
drafters that ride beside it (EAGLE-3, MTP, PARD, DFlash, DSpark), and their on-disk formats."""
from specjax.models.checkpoint_io import CheckpointError, read_safetensors
from specjax.models.bamba import Bamba
from specjax.models.config import ATTENTION, MAMBA, MambaConfig, ModelConfig, RopeScaling
from specjax.models.dflash_checkpoint import load_dflash_head, save_dflash_head
from specjax.models.dflash_head import DFlashHead, DFlashHeadConfig
from specjax.models.dspark_head import DSparkHead, DSparkHeadConfig
from specjax.models.eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.models.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from specjax.models.llama import Llama, dense_attention, rms_norm
from specjax.models.mtp_checkpoint import load_mtp_heads, save_mtp_heads
from specjax.models.mtp_head import MTPHeads, MTPModule
from specjax.models.pard_checkpoint import read_mask_token, save_pard_model

__all__ = ["ATTENTION", "Bamba", "CheckpointError", "DFlashHead", "DFlashHeadConfig", "DSparkHead", "DSparkHeadConfig",
           "Eagle3Head", "Eagle3HeadConfig", "MAMBA", "MambaConfig",
           "Llama", "MTPHeads", "MTPModule", "ModelConfig", "RopeScaling", "dense_attention",
           "load_dflash_head", "load_eagle3_head", "load_hf_checkpoint", "load_mtp_heads",
           "read_mask_token", "read_safetensors", "rms_norm", "save_dflash_head",
           "save_eagle3_head", "save_hf_checkpoint", "save_mtp_heads", "save_pard_model"]
