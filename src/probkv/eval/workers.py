"""Running units in worker processes (``probkv eval --workers N``).

Each worker is a spawned process that loads the model once and runs units from a shared
queue until a ``None`` sentinel; rows come back as they finish, so the parent appends them to
the results file in finishing order. A failing worker stops the others; the rows finished so
far still reach the parent first (a rerun resumes from them). Ctrl-C reaches every process of
the terminal's group: workers ignore SIGINT (from their first instruction: it is ignored while
they are spawned, and that disposition survives exec), the parent reports it once and stops
them with SIGTERM, on which they exit through their finalizers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import signal
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from probkv.eval.batching import run_batch
from probkv.eval.job import JobSettings, load_prepared_model
from probkv.eval.plan import Unit


def _worker_main(settings: JobSettings, threads: int, tasks, results) -> None:
    """A worker process: load the model once, run batches of units (``probkv.eval.batching``;
    usually one unit each) until the ``None`` sentinel, send ``("row", row)`` per finished
    job and ``("done", n)`` per batch; ``("error", text)`` on
    failure. Ctrl-C reaches every process of the terminal's group: a worker ignores it, and
    the parent, which reports it once, stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # terminate() (SIGTERM) exits through the finalizers, which release the semaphores this
    # process made (tqdm's lock): a plain kill would leave the resource tracker to warn
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        model, tokenizer = load_prepared_model(settings.model, threads, settings.dtype)
        while (batch := tasks.get()) is not None:
            for row in run_batch(model, tokenizer, batch, settings):
                results.put(("row", row))
            results.put(("done", sum(len(unit.jobs) for unit in batch)))
    except SystemExit:  # stopped by the parent, which no longer reads: do not wait on it
        results.cancel_join_thread()
        raise
    except BaseException:
        results.put(("error", traceback.format_exc()))


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while workers are spawned, so that a Ctrl-C during a worker's start
    (before it runs any Python of ours) cannot print a traceback there; the parent handles
    it. Outside the main thread, where handlers cannot change, nothing is done."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def run_in_workers(
    batches: Sequence[Sequence[Unit]], settings: JobSettings, workers: int, threads: int
) -> Iterator[dict[str, Any]]:
    """Run batches of units (``probkv.eval.batching.plan_batches``) in ``workers`` spawned
    processes (each loads the model once, with ``threads`` torch threads); yield rows as they
    finish. A failure in a worker stops the others and raises."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for batch in batches:
        tasks.put(list(batch))
    procs = [
        ctx.Process(target=_worker_main, args=(settings, threads, tasks, results), daemon=True)
        for _ in range(workers)
    ]
    for _ in procs:
        tasks.put(None)
    with _sigint_ignored():  # inherited through exec: ignored from the worker's first line
        for p in procs:
            p.start()
    expected = sum(len(u.jobs) for batch in batches for u in batch)
    received = 0
    try:
        while received < expected:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a worker process died (exit code {dead[0].exitcode}); finished jobs "
                        "are saved, rerun to resume"
                    ) from None
                continue
            if kind == "error":
                # Keep what the other workers already finished, then stop.
                with contextlib.suppress(queue.Empty):
                    while True:
                        other_kind, other = results.get(timeout=0.5)
                        if other_kind == "row":
                            received += 1
                            yield other
                raise RuntimeError(f"a worker failed; finished jobs are saved:\n{payload}")
            if kind == "row":
                received += 1
                yield payload
    finally:
        for p in procs:
            if p.is_alive() and received < expected:
                p.terminate()
        for p in procs:
            p.join(timeout=30)
        for q in (tasks, results):  # an interrupted run leaves items: read them, so that
            with contextlib.suppress(queue.Empty, OSError, EOFError):  # nothing waits on a
                while True:  # full pipe at exit and the queues' semaphores are released
                    q.get(timeout=0.1)
            q.cancel_join_thread()
            q.close()
