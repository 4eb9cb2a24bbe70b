"""Which worker runs each in-step mode: every worker module registers its own factory
(`@register(mode)`), and `specjax.speculative.build.get_spec_worker` looks the mode up -- no
chain of mode names. A new in-step drafter is one module plus its registration."""
from __future__ import annotations

from typing import Any, Callable

from specjax.core.worker import DraftWorker
from specjax.models.config import ModelConfig
from specjax.speculative.modes import SpeculativeDecodingMode

# (config, graphdef of the drafter's inference layout, the drafter module, the target's
# config) -> the worker. Raise ValueError naming the field for what the worker cannot run.
WorkerFactory = Callable[[Any, Any, Any, ModelConfig], DraftWorker]
WORKERS: dict[SpeculativeDecodingMode, WorkerFactory] = {}


def register(mode: SpeculativeDecodingMode) -> Callable[[WorkerFactory], WorkerFactory]:
    """Make the decorated factory the worker of `mode`."""
    def add(factory: WorkerFactory) -> WorkerFactory:
        WORKERS[mode] = factory
        return factory
    return add
