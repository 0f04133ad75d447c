"""Loader worker processes: forked, one pipe each, failures and deaths told to the main process.

Each worker fills its lane of the BatchRing and sends a small ticket per batch through
its own pipe; the ring's free slots are the only flow control. torch's DataLoader did
this job before, and its extra machinery cost a worker 10-20% of its tiles/s here (a
feeder thread and an index queue per worker, woken several times per batch on the
worker's own core; measured against the same reading in a plain forked process).

Workers are forked: a spawned worker re-imports torch (seconds per worker and per slide)
and re-runs the caller's main module, which breaks Snakemake scripts and notebooks. Forking
is safe because workers never touch CUDA or torch's thread pools and each opens its own
slide handle (OpenSlide handles must not cross a fork); the caller forks before it starts
any thread of its own.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from slidesnake.errors import LoaderWorkerError, SlidesnakeError
from slidesnake.loader.batch_ring import RingOrphaned

# A worker's tickets, given its lane and the number of lanes.
TicketSource = Callable[[int, int], Iterator[Any]]


class LoaderWorkers:
    """`count` forked processes; worker k sends the tickets of `tickets(k, count)`."""

    def __init__(self, tickets: TicketSource, count: int) -> None:
        context = multiprocessing.get_context("fork")
        self._pipes: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        for lane in range(count):
            receiving, sending = context.Pipe(duplex=False)
            process = context.Process(
                target=_work,
                args=(tickets, lane, count, sending),
                name=f"slidesnake-loader-{lane}",
                daemon=True,
            )
            process.start()
            sending.close()  # the worker's end: its exit then shows as the pipe's end
            self._pipes.append(receiving)
            self._processes.append(process)

    def receive(self, lane: int) -> Any:
        """The next ticket of worker `lane`, None once it is done; raises what it raised."""
        pipe, process = self._pipes[lane], self._processes[lane]
        wait([pipe, process.sentinel])
        if pipe.poll():
            try:
                message = pipe.recv()
            except (EOFError, OSError):
                pass  # the pipe closed without a word: the worker died
            else:
                if isinstance(message, BaseException):
                    raise message
                return message
        process.join()
        raise _died(lane, process.exitcode)

    def close(self) -> None:
        """Stop every worker that is still running and reap them all."""
        for process in self._processes:
            if process.is_alive():
                process.kill()  # a worker holds nothing that needs cleaning up
        for process in self._processes:
            process.join()
        for pipe in self._pipes:
            pipe.close()


def _work(tickets: TicketSource, lane: int, lanes: int, pipe: Connection) -> None:
    # Ctrl-C reaches the whole process group; the main process stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the job's handler, inherited
    try:
        for ticket in tickets(lane, lanes):
            pipe.send(ticket)
        pipe.send(None)
    except (RingOrphaned, BrokenPipeError):
        pass  # the main process is gone
    except BaseException as err:
        pipe.send(_portable(err, lane))


def _portable(err: BaseException, lane: int) -> BaseException:
    """`err` if it survives pickling (slidesnake's errors do), else its traceback as text."""
    if isinstance(err, SlidesnakeError):
        try:
            pickle.loads(pickle.dumps(err))
            return err
        except Exception:
            pass
    return LoaderWorkerError(f"loader worker {lane} failed:\n{traceback.format_exc()}")


def _died(lane: int, exitcode: int | None) -> LoaderWorkerError:
    """The error for a worker that exited without its last word."""
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return LoaderWorkerError(
        f"loader worker {lane} {how} before it read all its tiles. Fix: if the system ran "
        "out of memory (SIGKILL from the OOM killer), lower loader.workers or "
        "loader.prefetch, or give the job more memory; then run the job again"
    )
