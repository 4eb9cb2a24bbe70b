"""`python -m specjax.serve`: serve a model over an OpenAI-compatible HTTP API.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming with SSE or not),
llama.cpp's POST /completion and POST /infill (fill in the middle, for code editors),
GET /v1/models, GET|HEAD /health, GET /metrics (Prometheus). Prompt prefixes seen before reuse
their K/V (the prefix cache) unless --no-prefix-cache.

Limits: request heads and bodies must arrive within --request-timeout (else 408), at most
--max-concurrency requests run at once (else 503), only --allowed-hosts are answered (else
400), and shutdown (SIGINT/SIGTERM) waits at most --shutdown-timeout for requests in flight
before ending them with an error.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from specjax.cli import MODEL_HELP, QUIET_LOGGERS, HelpFormatter
from specjax.serve.defaults import parse_speculative_config, served_model_name
from specjax.speculative.defaults import speculative_config_help

log = logging.getLogger("specjax.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specjax.serve", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", default="bundled",
                        help=MODEL_HELP)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: the folder's name, a GGUF "
                             "file's without .gguf; "
                             "the --model value is accepted too)")
    parser.add_argument("--speculative-config", default=None, help=speculative_config_help(
        "EAGLE-3 with the shipped head (bundled-eagle3) for the bundled model, rejection "
        "sampling for sampled requests; NGram asking for evidence for smollm2; none for "
        "other models"))
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (loopback only unless told otherwise)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $SPECJAX_API_KEY "
                             "if set, else no key; an empty key is an error, not 'no auth')")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host header names answered, '*' for any "
                             "(default: localhost, 127.0.0.1, [::1], plus the --host address "
                             "if it is not loopback; any host for 0.0.0.0 or ::)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="requests decoded together in one step")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV-cache blocks in the pool (default: room for max-batch-size "
                             "full-length requests)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests that may wait for a slot before new ones get 429")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="largest max_tokens a request may ask for (default: the context)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="largest request body accepted (else 413)")
    parser.add_argument("--max-concurrency", type=int, default=512,
                        help="HTTP requests in flight (streams included) before new ones get "
                             "503; /health and /metrics are exempt")
    parser.add_argument("--request-timeout", type=float, default=30.0,
                        help="seconds a client has to send a request's head, and again its "
                             "body, before a 408")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds requests in flight get to finish on shutdown before "
                             "they end with an error")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not reuse the K/V of prompt prefixes seen before (default: "
                             "reused; blocks no request holds stay findable until evicted)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="devices the model is split over, Megatron-style (default: 1, "
                             "or every device of a multi-process job)")
    parser.add_argument("--coordinator-address", default=None,
                        help="HOST:PORT of process 0 in a multi-process job (jax.distributed); "
                             "every process gets the same arguments but --process-id (default: "
                             "none, one process)")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes in the job; process 0 serves HTTP, the others run "
                             "its steps on their devices")
    parser.add_argument("--process-id", type=int, default=0, help="this process's index")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter dtype (default: the checkpoint's; a GGUF's quantized "
                             "weights stay quantized unless a dtype is named)")
    parser.add_argument("--quantize", choices=("q8_0", "q4_0"), default=None,
                        help="quantize a float checkpoint's weights at load, its LM head to "
                             "q8_0 (default: none, the checkpoint's own weights)")
    parser.add_argument("--activation-bits", type=int, choices=(16, 8), default=16,
                        help="bits the CPU kernel rounds x to against quantized weights: 16 "
                             "keeps logits within 0.05 of the float product; 8 (llama.cpp's "
                             "Q8 activations) is faster on AVX2-only CPUs and moves them "
                             "(default: 16; a draft model takes the same)")
    parser.add_argument("--seed", type=int, default=None,
                        help="draws the seeds of requests that give none (default: random)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="server and engine log level")
    return parser


def describe(spec) -> str:
    """The speculation a server runs, for its start-up line."""
    if spec is None:
        return "off"
    drafter = getattr(spec, "speculative_model", None)
    return (f"{spec.mode.name}, max_draft_len {spec.max_draft_len}"
            + (f", drafter {drafter}" if isinstance(drafter, str) else "")
            + (", rejection sampling for sampled requests" if spec.use_rejection_sampling
               else ""))


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $SPECJAX_API_KEY; a key given but empty is an error, never 'no auth'."""
    key, source = flag, "--api-key"
    if key is None:
        key, source = environ.get("SPECJAX_API_KEY"), "$SPECJAX_API_KEY"
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty: give a key, or leave it unset to serve "
                         "without one")
    return key


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    # Imported here so --help answers without loading JAX.
    from specjax.llm import LLM
    from specjax.serve.app import ServerSettings, create_app
    from specjax.serve.hosts import allowed_hosts_for, is_loopback
    from specjax.serve.http_server import build_server
    try:  # every argument is checked before the model loads
        api_key = api_key_from(args.api_key, os.environ)
        spec = parse_speculative_config(args.speculative_config, args.model)
        names = tuple(dict.fromkeys([args.served_model_name or served_model_name(args.model),
                                     str(args.model)]))
        given_hosts = None if args.allowed_hosts is None else args.allowed_hosts.split(",")
        settings = ServerSettings(model_names=names, api_key=api_key, max_queue=args.max_queue,
                                  max_tokens_cap=args.max_tokens_cap,
                                  max_body_bytes=args.max_body_bytes,
                                  allowed_hosts=allowed_hosts_for(args.host, given_hosts),
                                  max_concurrency=args.max_concurrency,
                                  request_timeout=args.request_timeout,
                                  shutdown_timeout=args.shutdown_timeout)
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        if (args.num_processes > 1) != (args.coordinator_address is not None):
            raise ValueError("a multi-process job needs both --coordinator-address and "
                             "--num-processes > 1")
        llm = LLM(args.model, dtype=args.dtype, quantize=args.quantize,
                  activation_bits=args.activation_bits,
                  max_batch_size=args.max_batch_size,
                  max_model_len=args.max_model_len, num_kv_blocks=args.kv_blocks,
                  seed=args.seed, speculative_config=spec,
                  enable_prefix_cache=not args.no_prefix_cache,
                  tensor_parallel_size=args.tensor_parallel_size,
                  coordinator_address=args.coordinator_address,
                  num_processes=args.num_processes, process_id=args.process_id,
                  warmup=args.num_processes > 1)
        if args.num_processes == 1:
            # /health answers while every program compiles on a thread; a request meanwhile
            # compiles what it needs first. Several processes warm up before serving: each
            # compiles as it follows process 0's device updates.
            llm.warmup(background=True)
        if args.process_id != 0:
            log.info("process %d runs process 0's steps until it stops", args.process_id)
            llm.follow()
            return 0
        app = create_app(llm, settings)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and api_key is None:
        log.warning("binding %s without --api-key: anyone who can reach it can use it", args.host)
    log.info("serving %r (speculation: %s) on http://%s:%d", names[0], describe(spec),
             args.host, args.port)
    server = build_server(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C, re-raised by uvicorn after shutdown
        pass
    finally:
        llm.close()  # other processes of a multi-process job stop with this one
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())
