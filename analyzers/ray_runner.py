"""Analyzers' Ray runner: the ledger's block-hash partitions (analyzers/partitions.py) as Ray tasks.

``kvlens analyze --ray [ADDRESS]``: with an address (``ray://host:10001``, ``host:6379`` or
``auto``) it joins that cluster; without one it starts a local cluster for this process
(``ray.init``) and shuts it down when the analysis ends, so no Ray process outlives it. Each
partition's arrays go to the object store once; its task returns the partition's phase-1 states (or
its reuse histogram), gathered in partition order, with at most two tasks per CPU in flight. Ray is
an extra: ``pip install 'kvlens[ray]'``.

A local cluster's workers run at this process's priority. Ray starts workers at niceness 15 by
default (``RAY_worker_niceness``, read by the raylet when it starts): on a machine busy with other
work at the default priority they then get a sliver of a CPU (measured here beside two CPU-bound
processes: 3.7% each, an analysis of minutes not done after six), while the same analysis without
``--ray`` would have its share. The caller's own ``RAY_worker_niceness`` wins; a cluster given by
address keeps its own setting (start it with ``RAY_worker_niceness=0 ray start ...`` for the same).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from kvlens.analyzers.partitions import Partitions, PhaseOne
from kvlens.errors import ConfigError, KvlensError

__all__ = ["ray_partitions"]

log = logging.getLogger(__name__)

def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'kvlens[ray]' "
                          "(or run without --ray: the same partitions run in this process)") from None
    return ray


@contextmanager
def ray_partitions(address: str | None, count: int | None = None) -> Iterator[Partitions]:
    """Partitions run as Ray tasks on the cluster at ``address`` (None: a local one, started
    here and shut down on exit); ``count`` partitions (default: chosen per scenario from its size
    and the cluster's CPUs, ``Partitions.for_rows``)."""
    ray = _ray()
    started = False
    if not ray.is_initialized():
        try:
            if address is None:
                os.environ.setdefault("RAY_worker_niceness", "0")  # the raylet started here reads it
                ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            said = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"cannot reach the Ray cluster at {address or 'a new local cluster'}: {said}: "
                              "start one (ray start --head) or pass its address to --ray; a cluster with "
                              "token authentication (Ray's default for local clusters from 2.59) needs "
                              "RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN here too") from None
        started = True
    cpus = int(ray.cluster_resources().get("CPU", 0))
    where = f"on Ray ({address or 'local cluster'}, {cpus} CPUs)"
    task = ray.remote(_call)

    def run(fn: Callable[..., Any], parts: Iterable[PhaseOne]) -> Iterator[Any]:
        # At most two tasks per CPU in flight: the partitions' arrays enter the object store a
        # window at a time, not all at once (bounded memory on the driver and in the store).
        pending: deque[Any] = deque()
        todo = iter(parts)
        done = 0
        while True:
            while len(pending) < 2 * max(cpus, 1) and (args := next(todo, None)) is not None:
                pending.append(task.remote(fn, *args))
            if not pending:
                return
            ref = pending.popleft()
            done += 1
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError as e:  # a worker died, or the task raised
                for left in pending:
                    ray.cancel(left, force=True)
                cause = getattr(e, "cause", None)  # a task's own exception (RayTaskError)
                said = (f"{type(cause).__name__}: {cause}" if cause is not None
                        else str(e).strip().splitlines()[-1])
                raise KvlensError(f"partition {done} failed {where}: {said}: see the Ray logs (ray logs) and "
                                  "rerun; without --ray the same partitions run in this process") from None
            log.info("partition %d done %s", done, where)
            yield got

    try:
        yield Partitions(count, run, where, max(cpus, 1))
    finally:
        if started:
            ray.shutdown()
