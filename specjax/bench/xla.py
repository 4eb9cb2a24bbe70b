"""XLA options and layer layouts: the compiled generation step under each, side by side.

Each XLA flag set runs in its own child process (XLA reads XLA_FLAGS once, when the backend
starts), timing the target's compiled generation step for 1 and 5 query tokens at batch 1 and
8 (best of 3 rounds of 20 calls) and recording its greedy output on a fixed prompt, which must
equal the first candidate's (flags that change the output are not an option). The candidates
are XLA:CPU's options on a CPU and the command-buffer (CUDA graph) options on a GPU
(`GPU_CANDIDATES`); the platform is read from what is installed, so this process never holds
the GPU the children need. The model: the random 27.8M Llama checkpoint (default), or a random
model of a real shape (--shape, `specjax.bench.shapes`). The first child also times the layer
layouts the engine could run: `lax.scan` over stacked layers and unrolled layers, with and
without q/k/v and gate/up fused (the engine runs unrolled+fused on CPU, scan+fused elsewhere).
The flags specjax sets by default are in `specjax/xla_flags.py`; this bench is how they are
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

from specjax.bench.shapes import SHAPES

# Candidate flag sets, each added to specjax's defaults. Flags the installed jaxlib does not
# know make its child fail; that row then says so.
CPU_CANDIDATES = [
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
# XLA:GPU command buffers (CUDA graphs): a type list with +/- edits XLA's default list, which
# (jaxlib 0.10.2's debug options, as an HLO dump records them) holds FUSION, CUBLAS, CUBLASLT,
# CUDNN, CUSTOM_CALL, DYNAMIC_SLICE_FUSION and CONDITIONAL: not WHILE (the scanned layers).
GPU_CANDIDATES = [
    "",
    "--xla_gpu_enable_command_buffer=",  # off: what the graphs are worth
    "--xla_gpu_enable_command_buffer=+WHILE",  # the layer loop inside the graph
    "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1",
    "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true",
]
LAYOUTS = ("scan", "scan+fused", "unrolled", "unrolled+fused")
PROMPT = [11, 7, 93, 250, 3, 41, 17, 8]  # the greedy-output check's prompt (ids < every vocab)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flags", action="append", default=None,
                        help="an XLA flag set to time (repeatable; default: the platform's "
                             "candidates)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="a random model of this shape (specjax.bench.shapes) instead of "
                             "the 27.8M checkpoint")
    parser.add_argument("--position", type=int, default=80,
                        help="the context position the compiled steps are timed at")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="layer layouts the first child times (comma-separated; empty: "
                             "none)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="batch sizes each candidate is timed at")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _child(model_arg: str, position: int, layouts: list[str], batches: list[int]) -> dict:
    from flax import nnx

    from specjax.analysis.timing import time_generation_steps
    from specjax.bench.shapes import random_model
    from specjax.core import Params
    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams

    if model_arg.startswith("shape:"):
        model = random_model(SHAPES[model_arg[len("shape:"):]])
        rows = max(batches)
        llm = LLM(model, max_batch_size=rows, max_model_len=position + 128,
                  num_kv_blocks=rows * ((position + 192) // 16) + 2, progress=False)
    else:
        llm = LLM(model_arg, max_model_len=256, progress=False, warmup=True)  # a short one
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True))[0]
    ex = llm.engine.executor
    variants = {"engine": (ex.graphdef, ex.params)}
    model = llm.model
    builds = {"scan": lambda: model.restacked(fused=False),
              "scan+fused": lambda: model.for_inference(scan_layers=True),
              "unrolled": lambda: model.unstacked(),
              "unrolled+fused": lambda: model.for_inference(scan_layers=False)}

    for name in layouts:
        graphdef, state = nnx.split(builds[name]())
        variants[name] = (graphdef, Params(target=nnx.to_pure_dict(state)))
    result = {"greedy": list(out.token_ids)}
    for name, (graphdef, params) in variants.items():
        ex.graphdef, ex.params = graphdef, params
        result[name] = {b: [t * 1e3 for t in time_generation_steps(llm.engine, b, [1, 5],
                                                                   position)]
                        for b in batches}
    return result


def _header(first: str, batches: list[int]) -> str:
    return f"{first:<72}" + "".join(f" {f'b{b} t({w})':>8}" for b in batches for w in (1, 5))


def _row(name: str, e: dict, batches: list[int]) -> str:
    return f"{name:<72}" + "".join(f" {t:>8.2f}" for b in batches for t in e[str(b)])


def run(args: argparse.Namespace) -> None:
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.position, layouts,
                                            args.batch_sizes)))
        return
    from specjax.analysis.timing import cpu_name
    from specjax.xla_flags import default_flags, gpu_plugin_installed

    gpu = gpu_plugin_installed()
    candidates = args.flags or (GPU_CANDIDATES if gpu else CPU_CANDIDATES)
    where = "a GPU" if gpu else f"{cpu_name()} ({os.cpu_count()} cores)"
    print(f"specjax's default XLA flags: {' '.join(default_flags()) or '(none)'}; compiled "
          f"generation step in ms at position {args.position}, best of 3 rounds of 20 calls, "
          f"on {where}; model: {args.shape or 'random-28m'}")
    batches = sorted(set(args.batch_sizes))
    print("\n" + _header("extra flags", batches) + "  greedy")
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            model_arg = f"shape:{args.shape}"
        else:
            from flax import nnx

            from specjax.bench.decode import RANDOM_28M
            from specjax.models import Llama, save_hf_checkpoint
            folder = Path(tmp) / "random-28m"
            save_hf_checkpoint(Llama(RANDOM_28M, rngs=nnx.Rngs(0)), folder)
            model_arg = str(folder)
        first, greedy = None, None
        for k, flags in enumerate(candidates):
            env = dict(os.environ, SPECJAX_EXTRA_XLA_FLAGS=flags)
            cmd = [sys.executable, "-m", "specjax.bench", "xla", "--child", model_arg,
                   "--position", str(args.position), "--batch-sizes", *map(str, batches),
                   "--layouts", ",".join(layouts) if k == 0 else ""]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                reason = (proc.stderr.strip().splitlines() or ["no output"])[-1][:60]
                print(f"{flags or '(defaults)':<72} failed: {reason}", flush=True)
                continue
            result = json.loads(line[len("RESULT "):])
            first = first or result
            greedy = greedy or result["greedy"]
            same = "same" if result["greedy"] == greedy else "DIFFERS"
            print(_row(flags or "(defaults)", result["engine"], batches) + f"  {same}",
                  flush=True)
    if first and layouts:
        print("\n" + _header("layer layout (default flags)", batches))
        for name in layouts:
            print(_row(name, first[name], batches))
