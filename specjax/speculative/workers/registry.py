"""Which worker runs each in-step mode, and how its drafter module is read: every worker module
registers its own factory and its drafter's loader (`@register(mode, load)`), and
`specjax.speculative.build` looks the mode up -- no chain of mode names or config types. A new
in-step drafter is one module plus its registration."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.core.worker import DraftWorker
from specjax.models.config import ModelConfig
from specjax.models.llama import Llama
from specjax.speculative.modes import SpeculativeDecodingMode

# (config, graphdef of the drafter's inference layout, the drafter module, the target's
# config) -> the worker. Raise ValueError naming the field for what the worker cannot run.
WorkerFactory = Callable[[Any, Any, Any, ModelConfig], DraftWorker]
WORKERS: dict[SpeculativeDecodingMode, WorkerFactory] = {}

# (config, the target, dtype) -> the drafter module the config names, as its folder holds it
# (read in `dtype`) or the instance given, checked against the target the same way.
DrafterLoader = Callable[[Any, Llama, str], Any]


@dataclasses.dataclass(frozen=True)
class DrafterModule:
    """How a mode's drafter module is read (`load`) and put in the layout the steps run
    (`for_inference`: fused projections). `layered`: it is built of target-style layers (a
    `Llama`, DFlash's body), which scan or unroll as the target's do (`scan_layers`); a head of
    one layer (EAGLE-3) or of separate modules (MTP) has one layout."""

    load: DrafterLoader
    layered: bool = False

    def for_inference(self, module: Any, scan_layers: bool) -> Any:
        return module.for_inference(scan_layers) if self.layered else module.for_inference()


DRAFTERS: dict[SpeculativeDecodingMode, DrafterModule] = {}


def register(mode: SpeculativeDecodingMode, load: DrafterLoader, layered: bool = False
             ) -> Callable[[WorkerFactory], WorkerFactory]:
    """Make the decorated factory the worker of `mode`, and `load` what reads its drafter
    module (`layered`: see `DrafterModule`)."""
    def add(factory: WorkerFactory) -> WorkerFactory:
        WORKERS[mode] = factory
        DRAFTERS[mode] = DrafterModule(load, layered)
        return factory
    return add
