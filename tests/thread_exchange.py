"""Helpers for tests of ops that exchange rows between ranks (routed experts dispatched):
instruction_set.experts_op.Exchange among threads of one process, one thread per member, and
running one callable per member at once. The runtime's exchange is an all-to-all over a
process group (runtime.collectives.alltoall.RowExchange)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class ThreadExchange:
    """instruction_set.experts_op.Exchange among threads, one per member."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.board = size, threading.Barrier(size), {}

    def member(self, m: int) -> "ThreadExchange.Member":
        return ThreadExchange.Member(self, m)

    def swap(self, m: int, pieces: list) -> list:
        """pieces[j] to member j; what each member sent me, by member."""
        self.board[m] = pieces
        self.barrier.wait()
        got = [self.board[j][m] for j in range(self.size)]
        self.barrier.wait()
        return got

    class Member:
        def __init__(self, hub: "ThreadExchange", m: int) -> None:
            self.hub, self.m = hub, m

        def counts(self, send: list[int]) -> list[int]:
            return self.hub.swap(self.m, send)

        def rows(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
            return _Swap.apply(rows, send, recv, self)


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send, recv, member):  # type: ignore[no-untyped-def]
        ctx.send, ctx.recv, ctx.member = send, recv, member
        return torch.cat(member.hub.swap(member.m, list(rows.split(send))))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return torch.cat(ctx.member.hub.swap(ctx.member.m, list(grad.split(ctx.recv)))), None, None, None


def together(calls: list[Callable[[], Any]], hub: ThreadExchange | None = None, timeout_s: float = 60.0) -> list[Any]:
    """Each call in its own thread, at once; their results in order. An error in one breaks
    the hub's barrier (so the others stop waiting) and is raised here."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = calls[k]()
        except BaseException as err:  # noqa: BLE001 (raised below, in the caller's thread)
            errors.append(err)
            if hub is not None:
                hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a member is still waiting for the others"
    return results
