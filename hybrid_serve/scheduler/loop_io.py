"""The I/O of `SchedulerLoop`: where its messages come from and where its answers go.

LoopIO       the interface; itself receives nothing and answers nowhere (a tensor-parallel
             follower's I/O: its inputs come from rank 0, only rank 0 replies)
PipeIO       the scheduler process: one `multiprocessing` pipe from the API process, one back
InProcessIO  the `Engine`: a queue in the same process; the caller takes the deltas and
             replies after each round
"""

from __future__ import annotations

from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from hybrid_serve.scheduler.messages import Heartbeat, QueryReply, TokenDelta


class LoopIO:
    def poll(self, timeout: float | None) -> bool:
        """Whether a message is waiting, after waiting for one up to `timeout` seconds (0: not
        at all, None: until one arrives)."""
        return False

    def recv(self) -> Any:
        """The next message (after `poll` said one is waiting)."""
        raise RuntimeError("this loop receives no messages (a follower's come from rank 0)")

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        """One round's token deltas, in the order they were built."""

    def send_reply(self, reply: QueryReply) -> None:
        """The answer to a `QueryMsg`."""

    def beat(self) -> None:
        """Tell the other end the loop is turning (no-op where nobody watches)."""


class PipeIO(LoopIO):
    """Messages over two one-way pipes; EOFError / BrokenPipeError when the other end is gone."""

    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        self.inbox, self.outbox = inbox, outbox

    def poll(self, timeout: float | None) -> bool:
        return self.inbox.poll(timeout)

    def recv(self) -> Any:
        return self.inbox.recv()

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        self.outbox.send(deltas)

    def send_reply(self, reply: QueryReply) -> None:
        self.outbox.send(reply)

    def beat(self) -> None:
        self.outbox.send(Heartbeat())


class InProcessIO(LoopIO):
    """A queue in the caller's thread: nothing arrives while the loop waits, so `poll` never
    blocks (a wait on an empty queue is a caller bug and raises)."""

    def __init__(self) -> None:
        self.inbox: deque[Any] = deque()
        self.deltas: list[TokenDelta] = []
        self.replies: list[QueryReply] = []

    def put(self, msg: Any) -> None:
        self.inbox.append(msg)

    def poll(self, timeout: float | None) -> bool:
        if not self.inbox and timeout is None:
            raise RuntimeError("in-process loop would wait forever for a message")
        return bool(self.inbox)

    def recv(self) -> Any:
        return self.inbox.popleft()

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        self.deltas.extend(deltas)

    def send_reply(self, reply: QueryReply) -> None:
        self.replies.append(reply)

    def take_deltas(self) -> list[TokenDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas
