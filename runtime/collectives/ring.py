"""One step of a ring over a group's members: send to the next member, receive from the
previous one. The ring all-gather and reduce-scatter are g-1 such steps, and the fused
collective-matmuls (runtime.collectives.fused) post theirs here too.

`post_beside` posts a step from a thread of its own (one per process, `Poster`) and returns at
once: gloo writes the first part of a send, what the socket takes, on the posting thread, so
posted from the main thread that copy runs before the matmul it should hide under (inside an
emulated node, loopback: all of the transfer's CPU; on a GPU the copy engine's). The fused
collective-matmuls post this way; a caller waits the step (`Posted.wait`) before it posts
anything else on the group, so steps keep their order.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from hetsynth.runtime.collectives.span import Span


def post(send: torch.Tensor | None, recv: torch.Tensor | None, span: Span, direction: int = 1) -> list[Any]:
    """Post a ring step (send to the member `direction` ahead, receive from the one behind);
    empty tensors are skipped. Returns the works, to be waited exactly once.

    The receive is posted first. Gloo's TCP pair sends a buffer only once the peer has said
    that its receive is posted (a NOTIFY_RECV_READY message on the same TCP stream as the
    data). In a two-member ring both ranks send and receive over one connection: posted send
    first, a rank's data can enter the stream before its own recv-ready notice, which then waits
    behind the whole message, and the peer's transfer starts only when this one has arrived:
    the step takes twice the transfer (measured across the 200 Mbit/s emulated link: a 2 MiB
    fused step 155-164 ms instead of 78-87 ms in about 1 call of 10, never in 24 calls with the
    receive first; on the 50 Mbit/s pair, a layer's 256 KiB ring all-gather of sharded weights
    inside training steps 30-49 ms where the link takes 21 ms)."""
    g, i = span.size, span.index
    ops = []
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, span.members[(i - direction) % g], group=span.group))
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), span.members[(i + direction) % g], group=span.group))
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(send: torch.Tensor | None, recv: torch.Tensor | None, span: Span, direction: int = 1) -> None:
    """Send to the next member and receive from the previous one (post, each work waited
    exactly once); `direction` -1 runs the ring the other way round."""
    for work in post(send, recv, span, direction):
        work.wait()


class Posted:
    """A step handed to the poster: wait() waits until it is posted, then each work once."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._works: list[Any] = []
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error
        for work in self._works:
            work.wait()

    def _run(self, fn: Callable[[], list[Any]]) -> None:
        try:
            self._works = fn()
        except BaseException as err:  # handed to the waiting thread
            self._error = err
        self._ready.set()


class Poster:
    """One thread that posts the steps handed to it, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="hetsynth-ring-poster", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, posted = self._queue.get()
            posted._run(fn)

    def hand(self, fn: Callable[[], list[Any]]) -> Posted:
        posted = Posted()
        self._queue.put((fn, posted))
        return posted


_POSTER: list[Poster] = []
_POSTER_LOCK = threading.Lock()


def beside(fn: Callable[[], list[Any]]) -> Posted:
    """fn (which returns the works it posted, maybe none) run on the poster thread, after what
    was handed before it; wait the result exactly once."""
    with _POSTER_LOCK:
        if not _POSTER:
            _POSTER.append(Poster())
    return _POSTER[0].hand(fn)


def post_beside(send: torch.Tensor | None, recv: torch.Tensor | None, span: Span, direction: int = 1) -> Posted:
    """post(), from the poster thread (module docstring); wait the result exactly once."""
    return beside(lambda: post(send, recv, span, direction))


def copy_beside(dst: torch.Tensor, src: torch.Tensor) -> Posted:
    """dst.copy_(src) on the poster thread, as a GPU's copy engine would run it beside the
    compute: on the CPU the copy into a freshly allocated buffer is mostly the kernel's page
    faults and zeroing (3.2 ms of CPU for 8 MiB here, against 0.2 ms into touched memory)."""
    def run() -> list[Any]:
        with torch.no_grad():  # grad mode is per thread: the caller's (an autograd forward's) is off
            dst.copy_(src)
        return []
    return beside(run)
