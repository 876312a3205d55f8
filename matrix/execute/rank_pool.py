"""A group of worker ranks kept alive for all the distributed cells of a run.

Starting a process group costs seconds (start the processes, import torch and the stack,
rendezvous); a cell's steps take a fraction of one. So the ranks start once, join a real
process group (gloo on CPU, nccl on CUDA; a FileStore rendezvous on localhost), and cells
are sent to them: every call goes to every rank, and each rank answers.

One rank failing never hangs the run:
- a rank that raises answers with its exception (type, message, origin, traceback), and the
  cell fails with that exception's own signature (RankFailure);
- a rank that dies (a signal, os._exit) is seen at once through its closed pipe, and the
  cell fails naming the rank, its exit status and the end of its log (RankDied);
- a call past the cell's deadline kills every rank (RankTimeout): the timeout reaches them all.
In each case the ranks that did not answer may be stuck in a collective, so the pool is
stopped and the next call starts a new group.

The driver side (this module) needs no torch: ranks run matrix/execute/rank_worker.py.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from matrix.results.signatures import Signature, normalize_message

DEFAULT_WORLD_SIZE = 2
START_TIMEOUT_S = 180.0  # start, import, rendezvous: about 5 s on a quiet 2-core CPU
# After one rank has answered with an error, how long the others get to answer too before
# they are taken as stuck in a collective the failed rank never joined.
ERROR_GRACE_S = 10.0
LOG_TAIL_LINES = 12


class RankError(Exception):
    """A distributed call did not complete on every rank."""

    remote_signature: Signature | None = None


class RankFailure(RankError):
    """A rank raised. The cell's signature is the rank's exception's own (computed in the rank
    from its traceback), so the same bug has the same signature with and without ranks."""

    def __init__(self, rank: int, error: dict, others: list[str]) -> None:
        self.rank, self.error = rank, error
        text = f"rank {rank} raised {error['type']}: {error['message']}"
        if others:
            text += " (" + "; ".join(others) + ")"
        super().__init__(text)
        self.details = error.get("details")
        self.remote_signature = Signature("", error["type"], normalize_message(error["message"]), error["origin"])
        self.remote_traceback = error.get("traceback", "")
        self.payload = error.get("payload")  # what the rank had measured when it raised
        if error.get("phase"):
            self.matrix_phase = error["phase"]


class RankDied(RankError):
    """A rank's process ended while a call was running on it."""

    def __init__(self, rank: int, status: int | None, log_tail: str) -> None:
        self.rank, self.status = rank, status
        how = describe_status(status)
        super().__init__(
            f"rank {rank} died ({how}) while the call ran" + (f"; its log ends: {log_tail}" if log_tail else "")
        )
        self.remote_signature = Signature(
            "", "rank died", normalize_message(f"rank {rank} died ({how})"), "<rank process>"
        )


class RankTimeout(RankError):
    """The call ran past its deadline on some ranks; every rank was killed."""

    def __init__(self, waiting: list[int], seconds: float) -> None:
        self.waiting = waiting
        ranks = ", ".join(str(r) for r in waiting)
        super().__init__(f"rank(s) {ranks} did not answer within {seconds:.0f} s; every rank was killed")
        self.remote_signature = Signature(
            "", "rank timeout", "a rank did not answer within the cell's timeout", "<rank process>"
        )


class PoolStartError(RankError):
    """The group could not be started: no cell of it can run."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.remote_signature = Signature("", "rank pool", normalize_message(message), "<rank process>")


def describe_status(status: int | None) -> str:
    if status is None:
        return "still running"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


@dataclass
class Rank:
    index: int
    process: subprocess.Popen
    requests: Connection
    replies: Connection
    log: Path

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
        if not fatal:
            return " | ".join(line.strip() for line in lines[-LOG_TAIL_LINES:])
        # faulthandler's report starts with its cause and the innermost frames: keep those, and
        # before them what the C++ runtime printed of an uncaught exception (a collective's
        # size mismatch in gloo: "terminate called after throwing ..." and its what())
        start = fatal[-1]
        thrown = [i for i in range(max(0, start - LOG_TAIL_LINES), start) if lines[i].startswith("terminate called")]
        if thrown:
            start = thrown[-1]
        shown = lines[start : fatal[-1] + LOG_TAIL_LINES]
        return " | ".join(line.strip() for line in shown)


@dataclass
class RankPool:
    """`world_size` ranks of one process group on `device` ("cpu": gloo, "cuda": nccl)."""

    world_size: int = DEFAULT_WORLD_SIZE
    device: str = "cpu"
    ranks: list[Rank] = field(default_factory=list)
    directory: Path | None = None
    started_s: float | None = None  # how long the last start took
    starts: int = 0

    @property
    def alive(self) -> bool:
        return bool(self.ranks) and all(r.process.poll() is None for r in self.ranks)

    def start(self) -> None:
        self.stop()
        began = time.perf_counter()
        self.directory = Path(tempfile.mkdtemp(prefix="matrix-ranks-"))
        store = self.directory / "store"
        for index in range(self.world_size):
            request_read, request_write = os.pipe()
            reply_read, reply_write = os.pipe()
            log = self.directory / f"rank{index}.log"
            env = {
                **os.environ,
                "MATRIX_RANK": str(index),
                "MATRIX_WORLD_SIZE": str(self.world_size),
                "MATRIX_RANK_DEVICE": self.device,
                "MATRIX_RANK_STORE": str(store),
                "MATRIX_RANK_PIPES": f"{request_read},{reply_write}",
                # the ranks import what the driver can (a plugin's model kind, its test helpers)
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            }
            with open(log, "wb") as output:
                process = subprocess.Popen(
                    [sys.executable, "-m", "matrix.execute.rank_worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    pass_fds=(request_read, reply_write),
                    start_new_session=True,  # a signal meant for the run's process group is not theirs
                )
            os.close(request_read)
            os.close(reply_write)
            self.ranks.append(
                Rank(
                    index,
                    process,
                    Connection(request_write, readable=False),
                    Connection(reply_read, writable=False),
                    log,
                )
            )
        self.starts += 1
        try:
            ready = self._gather(START_TIMEOUT_S)
        except RankError as exc:
            self.stop()
            raise PoolStartError(f"the {self.world_size}-rank group on {self.device} did not start: {exc}") from None
        failed = [(i, value) for i, (status, value) in ready.items() if status != "ready"]
        if failed:
            self.stop()
            index, error = failed[0]
            raise PoolStartError(f"rank {index} could not join the group: {error['type']}: {error['message']}")
        self.started_s = time.perf_counter() - began

    def call(self, function: str, *args, timeout_s: float | None = None) -> list:
        """function(context, *args) on every rank ("module:name"); the ranks' return values, by
        rank. Raises RankFailure, RankDied or RankTimeout (and then stops the pool)."""
        if not self.alive:
            self.start()
        for rank in self.ranks:
            try:
                rank.requests.send(("call", function, args))
            except (BrokenPipeError, OSError):
                pass  # it died: _gather reports it
        replies = self._gather(timeout_s)
        errors = [(i, value) for i, (status, value) in sorted(replies.items()) if status == "error"]
        if errors:
            index, error = errors[0]
            others = [f"rank {i} raised {e['type']}: {e['message']}" for i, e in errors[1:]]
            if len(replies) < self.world_size:
                self.stop()  # a rank still waits in a collective the failed one never joined
            raise RankFailure(index, error, others)
        return [replies[i][1] for i in range(self.world_size)]

    def _gather(self, timeout_s: float | None) -> dict[int, tuple[str, object]]:
        """One answer from every rank; on a death or the deadline, stop and raise. After the first
        error answer the rest get ERROR_GRACE_S; those that do not answer are left out."""
        replies: dict[int, tuple[str, object]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_connection = {rank.replies: rank for rank in self.ranks}
        try:
            while len(replies) < len(self.ranks):
                waiting = [c for c, r in by_connection.items() if r.index not in replies]
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if any(status == "error" for status, _ in replies.values()):
                    remaining = ERROR_GRACE_S if remaining is None else min(remaining, ERROR_GRACE_S)
                    if not wait(waiting, remaining):
                        return replies  # the others are stuck: the caller stops the pool
                elif not wait(waiting, remaining):
                    self.stop(kill=True)  # at once: the cell's own timeout is close
                    raise RankTimeout(sorted(by_connection[c].index for c in waiting), timeout_s or 0.0)
                for connection in wait(waiting, 0):
                    rank = by_connection[connection]
                    try:
                        replies[rank.index] = connection.recv()
                    except (EOFError, OSError):
                        status = _status_after_exit(rank.process)
                        tail = rank.log_tail()
                        self.stop(kill=True)  # the others wait for the dead rank in a collective
                        raise RankDied(rank.index, status, tail) from None
        except RankError:
            raise
        except BaseException:
            # pytest-timeout's alarm, a KeyboardInterrupt: the ranks are mid-call, so they go too
            self.stop(kill=True)
            raise
        return replies

    def stop(self, kill: bool = False) -> None:
        """Ask every rank to leave (kill: do not ask), kill any that does not, and remove the
        group's files."""
        for rank in self.ranks:
            try:
                if kill:
                    rank.process.kill()
                else:
                    rank.requests.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 3.0
        for rank in self.ranks:
            try:
                rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
            rank.requests.close()
            rank.replies.close()
        self.ranks = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _status_after_exit(process: subprocess.Popen) -> int | None:
    """The exit status of a rank whose pipe just closed (it may take a moment to be reaped)."""
    try:
        return process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


_POOLS: dict[tuple[str, int], RankPool] = {}


def pool(device: str, world_size: int) -> RankPool:
    """The run's pool for a device and world size, started on first use and kept."""
    key = (device, world_size)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size=world_size, device=device)
    return _POOLS[key]


@atexit.register
def stop_all() -> None:
    for each in _POOLS.values():
        each.stop()
