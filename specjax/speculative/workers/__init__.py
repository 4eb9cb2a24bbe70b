"""In-step drafters (modes with `has_spec_decoder()`): each implements `specjax.core.DraftWorker`
and runs inside the jitted steps; each module registers its factory (`registry.WORKERS`) and its
drafter module's loader (`registry.DRAFTERS`)."""
from specjax.core.worker import DraftWorker
from specjax.speculative.workers.chain import ChainWorker, Eagle3Worker, MTPEagleWorker
from specjax.speculative.workers.draft_target import DraftTargetWorker
from specjax.speculative.workers.dspark import DSparkWorker
from specjax.speculative.workers.mtp import MTPWorker
from specjax.speculative.workers.parallel import DFlashWorker, PARDWorker
from specjax.speculative.workers.registry import DRAFTERS, WORKERS, register

__all__ = ["ChainWorker", "DFlashWorker", "DraftTargetWorker", "DraftWorker", "DSparkWorker", "Eagle3Worker",
           "MTPEagleWorker", "MTPWorker", "PARDWorker", "DRAFTERS", "WORKERS", "register"]
