"""Several processes as one JAX program: a multi-host TPU slice or GPU cluster (one process per
host), or several processes on one machine.

Every process runs the same command. ``initialize`` joins them (``jax.distributed``); then
``jax.devices()`` lists every process's devices and a mesh over them spans the hosts, while each
process holds and computes on its own (``jax.local_devices()``). What the pipeline adds on top:

* one process leads: it alone writes the logs, plans and exported files and draws progress bars
  (the others would write the same bytes);
* work that needs no collective (answering the training prompts, a batch job's requests) is
  split between processes by index, each on its own devices, and ``barrier`` waits for all of it;
* a decision taken from a process's own clock (a deadline) is the lead's on every process
  (``lead_value``), or some would step on while others stop, and wait for them forever.

Run directories must be on storage every process sees (a shared file system, or a bucket
mounted on every host): orbax writes each process's part of a checkpoint there, and each process
reads the shards the others wrote. With one process every function here is a no-op.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the run's other processes. With no arguments JAX finds them itself on a Cloud TPU
    slice, under SLURM, Open MPI or Kubernetes; elsewhere give all three (every process the same
    ``coordinator`` host:port, which process 0 listens on). Call it before anything else runs on
    a device."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("give the coordinator address, the number of processes and this process's id together "
                         "(or none of them, where JAX can find the cluster itself)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in 0..{num_processes - 1}")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def is_lead() -> bool:
    """Whether this process writes what the run writes once (logs, plans, exported drafters)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier of this name."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def lead_value(value):
    """The lead process's ``value`` (numbers or arrays, a pytree of them) on every process."""
    if jax.process_count() == 1:
        return value
    return jax.tree.map(lambda x: np.asarray(x).item() if np.ndim(x) == 0 else np.asarray(x),
                        multihost_utils.broadcast_one_to_all(value))


def share(items, process: int | None = None, processes: int | None = None) -> list:
    """The items (cache shards, requests) process ``process`` of ``processes`` works on, by
    default this process's of this run: every ``processes``-th, from its index. Interleaved, so
    that no process gets all of a file's long requests; fixed by position, not by what is left to
    do, so that processes looking at a half-written directory at slightly different times still
    split it without gap or overlap."""
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    return list(items)[process::processes]
