"""The processes of a tensor-parallel engine: start them, join them, watch them, stop them.

Rank 0 is the llmctl process that schedules (``serve``, ``chat``, ``bench`` or the Python
API on the head node). It starts its machine's other ranks as processes
(``torch.multiprocessing``, spawn). On each other machine, ``llmctl serve --node-rank R``
starts that machine's ranks and watches them (``run_worker_node``).

The ranks meet at a TCPStore that rank 0 hosts on ``master_addr:master_port`` (the usual
torch.distributed rendezvous) and form one process group: gloo on CPU, NCCL on CUDA (one
GPU per rank). Rank 0's commands (allocate the cache, run a step, stop) are objects
broadcast on a gloo group, so they never leave the CPU.

A failure reaches rank 0 within seconds and names the rank:

- a worker that raises writes its error to the store (``error/R``) before it exits; a
  worker machine writes there for a rank of its own that dies; rank 0 watches the exit
  codes of the workers it started;
- every worker adds to its heartbeat counter in the store each second: a counter that
  stops for ``HANG_AFTER_S`` is a hung rank;
- a collective waiting ``RANK_TIMEOUT_S`` for another rank fails (rank 0 pings idle
  workers, so their wait for the next command never gets that long).

Workers stop when rank 0 goes away: their collectives fail as its connections close,
their heartbeat cannot reach the store, and they watch their parent process.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmctl.errors import EngineDead, OptionError

logger = logging.getLogger("llmctl")

RANK_TIMEOUT_S = 20.0  # a collective or command waiting this long for a rank fails
HEARTBEAT_S = 1.0  # how often a worker says it is alive
HANG_AFTER_S = 10.0  # a worker silent this long has hung
PING_AFTER_S = 5.0  # rank 0 pings workers idle this long
JOIN_TIMEOUT_S = 600.0  # for every rank (other machines too) to reach the rendezvous
WATCH_S = 0.5  # how often rank 0 looks for a failure
STOP_TIMEOUT_S = 10.0  # for workers to exit after "stop", before they are killed

STOP = ("stop", None)
PING = ("ping", None)


@dataclass(frozen=True)
class Topology:
    """``size`` ranks over ``nnodes`` machines, meeting at ``master_addr:master_port``
    (``None``: rank 0 picks a free port, on one machine only)."""

    size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    device_type: str  # "cpu" or "cuda"
    cpu_threads: int | None = None  # this machine's, for all its ranks (None: its cores)

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The ranks this machine runs."""
        return range(
            self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node
        )

    def device(self, rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", rank - self.node_rank * self.ranks_per_node)
        return torch.device("cpu")

    def check_devices(self) -> None:
        """One GPU per rank on CUDA."""
        if self.device_type == "cuda" and torch.cuda.device_count() < self.ranks_per_node:
            raise OptionError(
                f"tensor_parallel_size {self.size} over {self.nnodes} machine(s) runs "
                f"{self.ranks_per_node} ranks here, one GPU each, but this machine has "
                f"{torch.cuda.device_count()} GPU(s)"
            )

    def threads_per_rank(self) -> int:
        """On CPU, this machine's cores (or ``cpu_threads``) split evenly among its ranks."""
        threads = self.cpu_threads or len(os.sched_getaffinity(0))
        return max(1, threads // self.ranks_per_node)


class HeadRanks:
    """Rank 0's side: hosts the rendezvous, starts this machine's other ranks as
    ``target(topology, task, rank)``, joins them all in the process group and watches them."""

    def __init__(
        self, topology: Topology, target: Callable[[Topology, Any, int], None], task: Any
    ) -> None:
        if dist.is_initialized():
            raise OptionError(
                "this process already runs a tensor-parallel engine: shut it down before "
                "starting another (one per process)"
            )
        topology.check_devices()
        if topology.nnodes == 1:
            _use_loopback()
        try:
            self.store = dist.TCPStore(
                topology.master_addr,
                topology.master_port or 0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=RANK_TIMEOUT_S),
            )
        except dist.DistError as exc:  # port in use, address not ours
            raise OptionError(
                f"cannot host the tensor-parallel rendezvous on {topology.master_addr}:"
                f"{topology.master_port or 'a free port'} ({exc}): choose another "
                "--master-port or --master-addr"
            ) from None
        self.topology = replace(topology, master_port=self.store.port)
        self.workers = self._start_workers(target, task)
        self.failure: str | None = None
        self.lock = threading.Lock()  # held by rank 0 through a command and the work after it
        self.on_failure: Callable[[str], None] | None = None
        self._closed = False
        self._last_command = time.monotonic()
        self._heartbeats: dict[int, tuple[int, float]] = {}  # rank -> (count, when it changed)
        self._check_lock = threading.Lock()

    @property
    def other_ranks(self) -> range:
        return range(1, self.topology.size)

    def _start_workers(self, target: Callable[[Topology, Any, int], None], task: Any) -> dict:
        context = torch.multiprocessing.get_context("spawn")
        workers = {}
        for rank in self.topology.node_ranks[1:]:
            process = context.Process(
                target=target,
                args=(self.topology, task, rank),
                name=f"llmctl-rank-{rank}",
                daemon=True,
            )
            process.start()
            workers[rank] = process
        return workers

    def wait_until_ready(self) -> None:
        """Join every rank in the process group and wait for each to load its shard (rank
        0 loads its own before calling this, while the workers start), then watch them and
        let them take commands. A rank that fails meanwhile raises ``EngineDead`` naming it."""
        try:
            self._wait_for_all("joined", JOIN_TIMEOUT_S)
            self.store.set("group", "1")  # the workers wait for it, so nobody waits long
            self.commands = join_process_group(self.topology, 0, self.store)
            self._wait_for_all("ready", None)
        except BaseException:
            self.close()
            raise
        self.store.set("go", "1")
        self._last_command = time.monotonic()
        self._watcher = threading.Thread(target=self._watch, name="llmctl-rank-watch", daemon=True)
        self._watcher.start()

    def _wait_for_all(self, stage: str, timeout: float | None) -> None:
        keys = [f"{stage}/{rank}" for rank in self.other_ranks]
        start = time.monotonic()
        if stage == "joined" and self.topology.nnodes > 1:
            logger.info(
                "waiting for the other %d machine(s) at %s:%d (ranks %d-%d)",
                self.topology.nnodes - 1,
                self.topology.master_addr,
                self.topology.master_port,
                self.topology.ranks_per_node,
                self.topology.size - 1,
            )
        while not self.store.check(keys):
            if reason := self.find_failure(heartbeats=stage != "joined"):
                raise EngineDead(reason)
            if timeout is not None and time.monotonic() - start > timeout:
                missing = [key.split("/")[1] for key in keys if not self.store.check([key])]
                raise EngineDead(
                    f"rank(s) {', '.join(missing)} did not reach the rendezvous at "
                    f"{self.topology.master_addr}:{self.topology.master_port} within "
                    f"{timeout:.0f} s: start `llmctl serve` with --node-rank on every machine"
                )
            time.sleep(0.1)

    def find_failure(self, heartbeats: bool = True) -> str | None:
        """Why a rank cannot go on (it exited, reported an error, or hung), else None."""
        with self._check_lock:
            for rank, process in self.workers.items():
                if process.exitcode is not None:
                    error = self._reported_error(rank)
                    return f"rank {rank} (pid {process.pid}) {describe_exit(process.exitcode)}" + (
                        f": {error}" if error else ""
                    )
            for rank in self.other_ranks:
                if error := self._reported_error(rank):
                    return f"rank {rank} failed: {error}"
            if heartbeats:
                return self._hung_rank()
        return None

    def _reported_error(self, rank: int) -> str | None:
        key = f"error/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _hung_rank(self) -> str | None:
        now = time.monotonic()
        for rank in self.other_ranks:
            count = self.store.add(f"heartbeat/{rank}", 0)
            last, since = self._heartbeats.get(rank, (-1, now))
            if count != last:
                self._heartbeats[rank] = (count, now)
            elif now - since > HANG_AFTER_S:
                return f"rank {rank} stopped responding (no heartbeat for {HANG_AFTER_S:.0f} s)"
        return None

    def broadcast(self, command: tuple) -> None:
        """Send ``command`` to every worker. The caller holds ``lock`` through the work
        that follows, so that a ping never comes between."""
        if self.failure is not None:
            raise EngineDead(self.failure)
        dist.broadcast_object_list([command], src=0, group=self.commands)
        self._last_command = time.monotonic()

    def diagnose(self, error: BaseException) -> str:
        """After a collective failed on rank 0: which rank caused it. Its exit, report or
        silence shows within moments; failing that, the error itself."""
        deadline = time.monotonic() + 3.0
        reason = self.failure
        while reason is None and time.monotonic() < deadline:
            reason = self.find_failure()
            time.sleep(0.2)
        reason = reason or f"rank 0 failed in a step: {type(error).__name__}: {error}"
        self._fail(reason)
        return reason

    def _fail(self, reason: str) -> None:
        """Remember the first failure; the other ranks cannot go on without this one."""
        with self._check_lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            logger.error("tensor-parallel engine failed: %s", reason)
        self._kill_workers()

    def _watch(self) -> None:
        while not self._closed and self.failure is None:
            time.sleep(WATCH_S)
            try:
                reason = self.find_failure()
            except Exception as exc:  # the store is rank 0's own: this should not happen
                reason = f"the rendezvous store failed: {exc}"
            if reason is None and time.monotonic() - self._last_command > PING_AFTER_S:
                reason = self._ping()
            if reason is not None and not self._closed:
                self._fail(reason)
                if self.on_failure is not None:
                    self.on_failure(reason)

    def _ping(self) -> str | None:
        """Keep idle workers' wait for a command short of the timeout."""
        if not self.lock.acquire(blocking=False):
            return None  # a command is running: no need
        try:
            self.broadcast(PING)
        except Exception as exc:
            return self.diagnose(exc)
        finally:
            self.lock.release()
        return None

    def close(self) -> None:
        """Stop every rank: in order when they are healthy, by force otherwise."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if self.failure is None and hasattr(self, "commands"):
            with self.lock:
                try:
                    self.broadcast(STOP)
                except Exception:
                    pass
            # The store (ours) must outlive the ranks' leaving the group, on every machine.
            stopped = [f"stopped/{rank}" for rank in self.other_ranks]
            while not self.store.check(stopped) and time.monotonic() < deadline:
                time.sleep(0.05)
        for process in self.workers.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        # The watcher must not be inside a store call when the interpreter exits (a daemon
        # thread stopped there aborts the process), so it is joined here.
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=WATCH_S + STOP_TIMEOUT_S)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_workers(self) -> None:
        for process in self.workers.values():
            if process.exitcode is None:
                process.kill()
        for process in self.workers.values():
            process.join(timeout=STOP_TIMEOUT_S)


class WorkerLink:
    """A worker rank's side: its store connection, heartbeat and commands."""

    def __init__(self, topology: Topology, rank: int) -> None:
        # Ctrl-C in a terminal reaches every process of the group: rank 0 (or this
        # machine's llmctl) stops the workers in order instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.rank = rank
        self._leaving = False
        self._parent = os.getppid()
        threading.Thread(target=self._watch_parent, name="llmctl-parent", daemon=True).start()
        self.store = dist.TCPStore(
            topology.master_addr,
            topology.master_port,
            is_master=False,
            timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        )
        self.store.set(f"joined/{rank}", "1")
        threading.Thread(target=self._beat, name="llmctl-heartbeat", daemon=True).start()
        self._wait_for("group")
        self.commands = join_process_group(topology, rank, self.store)

    def _beat(self) -> None:
        heart = f"heartbeat/{self.rank}"
        while not self._leaving:
            try:
                self.store.add(heart, 1)
            except Exception:  # the store lives in rank 0: it is gone
                if not self._leaving:
                    self.exit("lost the head node (rank 0)")
            time.sleep(HEARTBEAT_S)

    def _watch_parent(self) -> None:
        """Leave when the process that started this one dies (killed with no chance to
        stop its workers), so that no worker outlives it."""
        while os.getppid() == self._parent:
            time.sleep(0.5)
        self.exit("the llmctl process that started this rank died")

    def ready(self) -> None:
        """Say this rank has loaded its shard; wait until rank 0 sends commands."""
        self.store.set(f"ready/{self.rank}", "1")
        self._wait_for("go")

    def _wait_for(self, key: str) -> None:
        """Wait until rank 0 sets ``key`` (it may be loading its shard for minutes)."""
        while not self.store.check([key]):
            time.sleep(0.1)

    def receive(self) -> tuple[str, Any]:
        """The next command from rank 0 (pings are answered by receiving them)."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.commands)
            if box[0] != PING:
                return box[0]

    def report(self, message: str) -> None:
        """Tell rank 0 why this rank is stopping (best effort: the store may be gone)."""
        try:
            self.store.set(f"error/{self.rank}", message)
        except Exception:
            pass

    def exit(self, message: str) -> None:
        """Report, print and leave at once: after a failure, collectives may never return."""
        self.report(message)
        print(f"llmctl rank {self.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(1)

    def leave(self) -> None:
        """After "stop": leave the process group, tell rank 0 (it keeps the store up until
        every rank has left), and exit at once, before daemon threads can trip over an
        interpreter shutting down."""
        self._leaving = True
        dist.destroy_process_group()
        self.store.set(f"stopped/{self.rank}", "1")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def join_process_group(topology: Topology, rank: int, store: dist.Store) -> dist.ProcessGroup:
    """Form the process group of the model's collectives; return the group rank 0's
    commands travel on (gloo: CPU objects)."""
    device = topology.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore("group", store),
        rank=rank,
        world_size=topology.size,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )
    if device.type == "cuda":
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    return dist.group.WORLD


def run_worker_node(
    topology: Topology, target: Callable[[Topology, Any, int], None], task: Any
) -> None:
    """A worker machine (node_rank > 0): start its ranks and watch them until rank 0 stops
    them. A rank that fails stops the others and raises ``EngineDead`` naming it;
    SIGTERM or Ctrl-C stops them all."""
    topology.check_devices()
    logger.info(
        "worker node %d of %d: ranks %d-%d, rendezvous at %s:%d (the head node serves HTTP)",
        topology.node_rank,
        topology.nnodes,
        topology.node_ranks[0],
        topology.node_ranks[-1],
        topology.master_addr,
        topology.master_port,
    )
    try:
        store = dist.TCPStore(
            topology.master_addr,
            topology.master_port,
            is_master=False,
            timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        )
    except dist.DistError as exc:  # nothing listens there (within the timeout)
        raise EngineDead(
            f"cannot reach the head node's rendezvous at {topology.master_addr}:"
            f"{topology.master_port} ({exc}): start `llmctl serve --node-rank 0` there "
            "with the same --master-addr and --master-port"
        ) from None
    context = torch.multiprocessing.get_context("spawn")
    workers = {
        rank: context.Process(
            target=target, args=(topology, task, rank), name=f"llmctl-rank-{rank}"
        )
        for rank in topology.node_ranks
    }
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for process in workers.values():
            process.start()
        while workers:
            multiprocessing.connection.wait([p.sentinel for p in workers.values()], timeout=1.0)
            for rank, process in list(workers.items()):
                if process.exitcode is None:
                    continue
                del workers[rank]
                if process.exitcode != 0:
                    reason = f"rank {rank} (pid {process.pid}) {describe_exit(process.exitcode)}"
                    try:
                        if not store.check([f"error/{rank}"]):
                            store.set(f"error/{rank}", reason)
                    except Exception:
                        pass  # the head node is gone too
                    raise EngineDead(reason)
        logger.info("the head node stopped the engine")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process in workers.values():
            process.kill()
            process.join()


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _use_loopback() -> None:
    """The ranks of one machine talk over the loopback interface, whatever the host
    name resolves to (a user's GLOO_SOCKET_IFNAME wins). Spawned workers inherit it."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
