"""One worker per loaded model: a thread that drains a bounded queue of validated requests (the
model is not reentrant), turns each request's tokens into text pieces (stop strings applied), and
hands events back to the asyncio loop that waits for them.

A request is validated in the HTTP handler (tinyloop's own checks: generate_iter validates when it
is called, before the first token), so bad input is a 4xx before anything is queued. The worker
checks the request's cancel flag and deadline between tokens: a client that disconnects stops its
generation within one token, and a request past its deadline ends with what it has
(stop_reason DEADLINE)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

from ..errors import TinyLoopError
from ..runtime.config import GenerateStats, StopReason

#: The stop reason of a request that ran past its deadline.
DEADLINE = StopReason("DEADLINE")
#: The stop reason of a request whose client went away.
CANCELLED = StopReason("CALLBACK_ABORT")
#: The stop reason of a request that matched one of its stop strings.
STOP_STRING = StopReason("STOP_SEQUENCE")


class QueueFullError(TinyLoopError):
    """The request queue is full (HTTP 429 with Retry-After)."""


class ShuttingDownError(TinyLoopError):
    """The worker was stopped: a request it will never run (HTTP 503)."""


@dataclass
class Job:
    """One validated request: `tokens` is its generator (validated, not started); events go to
    `sink` (called on the worker thread) as ("text", piece) once per token (and once for text
    held back at the end), ("done", stop_reason) or ("error", exc)."""

    tokens: Iterator[int]
    stats: GenerateStats
    sink: Callable[[tuple], None]
    stops: Sequence[str] = ()
    deadline: float = float("inf")
    prompt_len: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None
    token_gaps: List[float] = field(default_factory=list)
    stop_reason: Optional[StopReason] = None
    started: bool = False          # the worker took it from the queue (set before it looks at the deadline)
    failed: bool = False           # it ended with an error event


class StopStrings:
    """Text pieces with stop strings applied: text that could still be the start of a stop string
    is held back until it cannot; at a match the text before it is the end of the completion (of
    several stop strings, the one the text completes first: the same cut whatever the pieces)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""         # received, not yet handed out
        self.hit = False

    def push(self, piece: str) -> str:
        """The text that can be handed out after `piece` ("" while held back)."""
        self.text += piece
        if self.stops:
            # the stop string the text completes first (earliest end, then earliest start): where
            # the text arriving a character at a time would stop, whatever pieces the tokens make
            found = [(i + len(s), i) for s, i in ((s, self.text.find(s)) for s in self.stops) if i >= 0]
            if found:
                self.hit = True
                out, self.text = self.text[:min(found)[1]], ""
                return out
        n = len(self.text) - self.keep if self.stops else len(self.text)
        out, self.text = self.text[:max(0, n)], self.text[max(0, n):]
        return out

    def flush(self) -> str:
        out, self.text = self.text, ""
        return out


class ModelWorker:
    """Owns a loaded model and runs its requests one at a time from a bounded queue."""

    def __init__(self, model, queue_size: int, on_finish: Optional[Callable[[Job], None]] = None):
        self.model = model
        self.queue: "queue.Queue[Optional[List[Job]]]" = queue.Queue(maxsize=queue_size)
        self.on_finish = on_finish
        self.running = 0               # requests being decoded now (0 or 1)
        self._thread = threading.Thread(target=self._loop, name="tinyloop-serve-worker", daemon=True)
        self._stopped = False
        self._then: Optional[Callable[[], None]] = None      # stop()'s `then`, run as the thread ends
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return self.queue.qsize() + self.running

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue the jobs of one request (one queue entry, run in order); QueueFullError when the
        queue is full (their generators are closed then)."""
        if not self._stopped:
            try:
                self.queue.put_nowait(list(jobs))
                return
            except queue.Full:
                for job in jobs:
                    job.tokens.close()
                raise QueueFullError(f"the request queue is full ({self.queue.maxsize} waiting); "
                                     f"retry later") from None
        for job in jobs:
            job.tokens.close()
        raise ShuttingDownError("the server is shutting down")

    def discard(self, jobs: Sequence[Job]) -> bool:
        """Take the queue entry of a request that was cancelled (its client went away, or it was
        answered at its deadline) out of the queue, if the worker has not taken it yet: its slot is
        free for the next request at once (not held until the requests ahead of it are done, 429s
        meanwhile), and its jobs end now as the worker would have ended them (counted once)."""
        jobs = list(jobs)
        if not jobs or jobs[0].started:
            return False
        with self.queue.mutex:
            entries = self.queue.queue
            at = next((k for k, entry in enumerate(entries) if entry and entry[0] is jobs[0]), None)
            if at is None:
                return False          # the worker took it (or stop() failed it)
            del entries[at]
            self.queue.not_full.notify()
        for job in jobs:
            self._skip(job)
        return True

    def stop(self, timeout: float = 10.0, then: Optional[Callable[[], None]] = None) -> None:
        """Fail what is queued (ShuttingDownError: those requests never ran, so they must not look
        like finished completions), let the running request end, stop the thread (waiting at most
        `timeout` seconds for it). `then` runs once no request runs any more: on the worker thread
        as it ends (so after a running request that outlasts `timeout`), here if it has ended."""
        if then is not None and not self._thread.is_alive():
            then()
        elif then is not None:
            earlier, later = self._then, then      # an earlier stop's, not run yet: both run
            self._then = later if earlier is None else (lambda: (earlier(), later()))
        self._stopped = True
        while True:
            try:
                jobs = self.queue.get_nowait()
            except queue.Empty:
                break
            for job in jobs or ():
                job.cancelled.set()
                job.tokens.close()
                self._done(job)
                job.sink(("error", ShuttingDownError("the server shut down before this request ran")))
        self.queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._then is not None:     # a thread that ended without it
            pending, self._then = self._then, None
            pending()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            jobs = self.queue.get()
            if jobs is None:
                then, self._then = self._then, None
                if then is not None:
                    then()
                return
            self.running = 1
            try:
                for k, job in enumerate(jobs):
                    try:
                        self._run(job)
                    except Exception as exc:    # outside the decode loop: that request fails, the worker goes on
                        try:
                            job.tokens.close()
                        except Exception:
                            pass
                        job.failed = True
                        self._done(job)
                        job.sink(("error", exc))
                    if job.failed:
                        # the request failed as a whole (a 5xx, or a stream ending at its error event):
                        # its other prompts are not decoded for a client that never gets them (CANCELLED, untouched)
                        for rest in jobs[k + 1:]:
                            rest.cancelled.set()
            finally:
                self.running = 0

    def _run(self, job: Job) -> None:
        job.started = True
        if job.cancelled.is_set() or time.perf_counter() >= job.deadline:
            # DEADLINE when the request was answered at its deadline (Request.events, which cancels
            # it afterwards as every answered request) or is past it with its client still there; a
            # client that went away first ended it (CANCELLED, counted as a 499)
            self._skip(job)
            return
        decoder = self.model.tokenizer.stream_decoder(continuation=True)
        eos = self.model.cfg.eos_ids
        text = StopStrings(job.stops)
        reason = None
        last = time.perf_counter()
        try:
            for tok in job.tokens:
                now = time.perf_counter()
                if job.first_token_s is None:
                    job.first_token_s = now - job.enqueued
                else:
                    job.token_gaps.append(now - last)
                last = now
                piece = text.push(decoder.push(tok)) if tok not in eos else ""
                job.sink(("text", piece))
                if text.hit:
                    reason = STOP_STRING
                elif job.cancelled.is_set():
                    reason = CANCELLED
                elif now >= job.deadline:
                    reason = DEADLINE
                if reason is not None:
                    break
        except Exception as exc:       # TinyLoopError, or a bug: the request fails, the server goes on
            job.tokens.close()
            job.failed = True
            self._done(job)
            job.sink(("error", exc))
            return
        job.tokens.close()
        if not text.hit:
            tail = text.push(decoder.flush())
            tail += text.flush() if not text.hit else ""
            if text.hit and reason is None:
                reason = STOP_STRING
            if tail:
                job.sink(("text", tail))
        self._finish(job, reason or job.stats.stop_reason)

    def _skip(self, job: Job) -> None:
        """End a job that never runs: DEADLINE, or CANCELLED when its client went away first."""
        job.tokens.close()
        expired = job.stop_reason == DEADLINE or not job.cancelled.is_set()
        self._finish(job, DEADLINE if expired else CANCELLED)

    def _finish(self, job: Job, reason) -> None:
        job.stop_reason = reason
        self._done(job)
        job.sink(("done", reason))

    def _done(self, job: Job) -> None:
        """Count the finished job (on_finish: the metrics) before its last event is handed out, so a
        client that has its answer sees it counted."""
        if self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:
                pass


class EventBox:
    """Events from the worker thread to one asyncio consumer, coalesced: the worker appends and
    wakes the loop only when no wake-up is pending, and the consumer takes everything that has
    arrived at once (one loop wake-up and one socket write per batch, not per token: the worker's
    decode loop and the event loop share the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self._armed = False
        self._lock = threading.Lock()

    def put(self, event: tuple) -> None:
        """Called on the worker thread (Job.sink)."""
        self.items.append(event)
        with self._lock:
            if self._armed:
                return
            self._armed = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:        # the loop is closed: nobody is waiting any more
            pass

    def _wake(self) -> None:
        with self._lock:
            self._armed = False
        self.ready.set()

    async def take(self, deadline: Optional[float] = None) -> List[tuple]:
        """Every event that has arrived (waits for at least one; none when `deadline`, a
        time.perf_counter() value, passes first)."""
        while not self.items:
            self.ready.clear()
            if self.items:
                break
            if deadline is None or deadline == float("inf"):
                await self.ready.wait()
                continue
            try:
                await asyncio.wait_for(self.ready.wait(), max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                if not self.items:
                    return []
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out
