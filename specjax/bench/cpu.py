"""XLA:CPU options and layer layouts: the compiled generation step under each, side by side.

Each XLA flag set runs in its own child process (XLA reads XLA_FLAGS once, when the backend
starts) on the same random 27.8M Llama checkpoint, timing the target's compiled generation
step for 1 and 5 query tokens at batch 1 and 8 (best of 3 rounds of 20 calls). The first
child also times the layer layouts the engine could run: `lax.scan` over stacked layers and
unrolled layers, each with and without q/k/v and gate/up fused (on CPU the engine runs
unrolled+fused; `scan_layers=True` scans).
The flags specjax sets by default are in `specjax/xla_flags.py`; this bench is how they were
chosen.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Candidate flag sets, each added to specjax's defaults. Flags the installed jaxlib does not
# know make its child fail; that row then says so.
CANDIDATES = [
    "",
    "--xla_cpu_use_xnnpack=false",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "--xla_cpu_use_thunk_runtime=false",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flags", action="append", default=None,
                        help="an XLA flag set to time (repeatable; default: the candidates)")
    parser.add_argument("--position", type=int, default=80,
                        help="the context position the compiled steps are timed at")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", action="store_true", help=argparse.SUPPRESS)


def _child(folder: str, position: int, layouts: bool) -> dict:
    from flax import nnx

    from specjax.analysis.timing import time_generation_steps
    from specjax.core import Params
    from specjax.llm import LLM

    llm = LLM(folder, max_model_len=256, progress=False, warmup=True)  # a short one per child
    ex = llm.engine.executor
    variants = {"engine": (ex.graphdef, ex.params)}
    if layouts:
        model = llm.model
        for name, m in (("scan", model), ("scan+fused", model.for_inference()),
                        ("unrolled", model.unstacked()),
                        ("unrolled+fused", model.for_inference(scan_layers=False))):
            graphdef, state = nnx.split(m)
            variants[name] = (graphdef, Params(target=nnx.to_pure_dict(state)))
    result = {}
    for name, (graphdef, params) in variants.items():
        ex.graphdef, ex.params = graphdef, params
        result[name] = {b: [t * 1e3 for t in time_generation_steps(llm.engine, b, [1, 5],
                                                                   position)]
                        for b in (1, 8)}
    return result


def run(args: argparse.Namespace) -> None:
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.position, args.layouts)))
        return
    from flax import nnx

    from specjax.analysis.timing import cpu_name
    from specjax.bench.decode import RANDOM_28M
    from specjax.models import Llama, save_hf_checkpoint
    from specjax.xla_flags import DEFAULT_FLAGS

    print(f"specjax's default XLA flags: {' '.join(DEFAULT_FLAGS) or '(none)'}; compiled "
          f"generation step in ms at position {args.position}, best of 3 rounds of 20 calls, "
          f"on {cpu_name()} ({os.cpu_count()} cores)")
    print(f"\n{'extra flags':<72} {'b1 t(1)':>8} {'b1 t(5)':>8} {'b8 t(1)':>8} {'b8 t(5)':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "random-28m"
        save_hf_checkpoint(Llama(RANDOM_28M, rngs=nnx.Rngs(0)), folder)
        layouts = None
        for k, flags in enumerate(args.flags or CANDIDATES):
            env = dict(os.environ, SPECJAX_EXTRA_XLA_FLAGS=flags)
            cmd = [sys.executable, "-m", "specjax.bench", "cpu", "--child", str(folder),
                   "--position", str(args.position)] + (["--layouts"] if k == 0 else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                reason = (proc.stderr.strip().splitlines() or ["no output"])[-1][:60]
                print(f"{flags or '(defaults)':<72} failed: {reason}", flush=True)
                continue
            result = json.loads(line[len("RESULT "):])
            if k == 0:
                layouts = result
            e = result["engine"]
            print(f"{flags or '(defaults)':<72} {e['1'][0]:>8.2f} {e['1'][1]:>8.2f} "
                  f"{e['8'][0]:>8.2f} {e['8'][1]:>8.2f}", flush=True)
    if layouts:
        print(f"\nlayer layout (default flags){'':<44} {'b1 t(1)':>8} {'b1 t(5)':>8} "
              f"{'b8 t(1)':>8} {'b8 t(5)':>8}")
        for name in ("scan", "unrolled", "unrolled+fused"):
            e = layouts[name]
            print(f"{name:<72} {e['1'][0]:>8.2f} {e['1'][1]:>8.2f} {e['8'][0]:>8.2f} "
                  f"{e['8'][1]:>8.2f}")
