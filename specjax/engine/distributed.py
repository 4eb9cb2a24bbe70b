"""Several processes, one engine: `jax.distributed` and the commands process 0 sends.

Every process runs the same jitted steps on one global mesh (SPMD: each launches the step for
its own devices, and the steps' collectives join them). Only process 0 has requests: it runs
the host loop (and the HTTP server) and, before each device update, sends that update's small
host inputs -- the padded batch, a slot to start -- to the others, which apply the same update
to their shards (`Executor.follow`). Commands travel through the key-value store of JAX's
coordination service (the one `jax.distributed.initialize` starts), not over the devices: they
need no compile, any size fits, and an idle server waits without a collective timing out.

When process 0 stops it sends "stop"; the others return from `follow` and leave
`jax.distributed` together with it. If it dies instead, JAX's coordination service ends the
others within the heartbeat timeout.
"""
from __future__ import annotations

import logging
import pickle
from typing import Any

import jax

log = logging.getLogger("specjax.engine")

LEADER = 0
HEARTBEAT_TIMEOUT_S = 10     # a process gone this long ends the others
SHUTDOWN_TIMEOUT_S = 30      # how long leaving waits for every process to leave too
KEEP_COMMANDS = 256          # commands kept in the store (a follower is never this far behind)
_POLL_MS = 1000


def initialized() -> bool:
    from jax._src import distributed
    return distributed.global_state.client is not None


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the job: `num_processes` processes, this one `process_id`, process 0 at
    `coordinator_address` (HOST:PORT). Call before anything else uses JAX (a model built in
    this process first: call this first). Joining twice is refused by JAX."""
    if not isinstance(num_processes, int) or num_processes < 2:
        raise ValueError(f"num_processes must be an int >= 2 for a multi-process job, got "
                         f"{num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id!r}")
    host, _, port = (coordinator_address or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be HOST:PORT, got {coordinator_address!r}")
    # CPU devices of several processes reduce over gloo; GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    log.info("process %d of %d joined %s: %d devices, %d here", process_id, num_processes,
             coordinator_address, jax.device_count(), jax.local_device_count())


def is_leader() -> bool:
    return jax.process_index() == LEADER


class Channel:
    """Commands from process 0 to the others, in order (pickled: they come from the job's
    own process 0 through its coordination service, nothing else writes there)."""

    def __init__(self):
        if not initialized():
            raise RuntimeError("several JAX processes but no jax.distributed client: "
                               "start them with specjax.engine.distributed.initialize")
        from jax._src import distributed  # the client jax.distributed.initialize made
        self.client = distributed.global_state.client
        self.sent = self.received = 0
        self.closed = False  # process 0 sent "stop"

    @staticmethod
    def _key(n: int) -> str:
        return f"specjax/command/{n}"

    def send(self, command: Any) -> None:
        self.sent += 1
        self.client.key_value_set_bytes(self._key(self.sent), pickle.dumps(command))
        if self.sent > KEEP_COMMANDS:
            self.client.key_value_delete(self._key(self.sent - KEEP_COMMANDS))

    def receive(self) -> Any:
        """The next command; waits as long as process 0 is idle."""
        self.received += 1
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(self._key(self.received),
                                                                _POLL_MS)
                return pickle.loads(data)
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
