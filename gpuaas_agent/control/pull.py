"""The node's one JetStream pull, and the only module that knows nats.py's internals.

Why a hand-written pull and not nats.py's ``fetch``: ``fetch(batch=1)`` holds a first message until
the batch fills or the pull expires, its ``heartbeat=`` waits out the whole expiry when the
heartbeats stop (an R1 consumer on a cluster member that died while our server did not), and its
``next_msg`` drops a message when a cancel (a reconnect kick, a stop) lands just as the message is
handed over. So the pull publishes the request itself and reads the subscription's queue itself.

That needs five private attributes of nats.py (``NATS_PY_INTERNALS``). They are read here and
nowhere else, in the package or the benches (tests/control/test_pull.py pins them against the
installed nats.py and checks that no other file names them): an upgrade of nats.py that renames one
fails there, in one place, not as a stuck pull in the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from importlib import metadata
from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header
from nats.js.client import JetStreamContext

# (owner, attribute, type): what this module reads or writes of nats.py's private state.
# PullSubscription._sub: the deliver inbox's Subscription; ._nms: the consumer's next-message subject;
# ._deliver: the inbox the server answers on. Subscription._pending_queue / ._pending_size: the
# messages delivered and not yet read, and their byte count (nats.py's slow-consumer accounting).
NATS_PY_INTERNALS: Final = (
    ("PullSubscription", "_sub", Subscription),
    ("PullSubscription", "_nms", str),
    ("PullSubscription", "_deliver", str),
    ("Subscription", "_pending_queue", asyncio.Queue),
    ("Subscription", "_pending_size", int),
)


def nats_py_version() -> str:
    """The installed nats.py (named in the pin test's failure)."""
    try:
        return metadata.version("nats-py")
    except metadata.PackageNotFoundError:  # installed under another distribution name
        return "unknown"


class PullSilent(Exception):
    """A pull got neither a message nor a heartbeat for two heartbeat intervals (its server lost it)."""

    def __init__(self, silent_s: float) -> None:
        super().__init__(f"no heartbeat for {silent_s:.1f}s")
        self.silent_s = silent_s


def pull_status(msg: Msg) -> str | None:
    """A JetStream status on a pull (100 heartbeat, 404/408 no message/expired, 409 ...); None for a message.

    A stored message always comes with its ack subject as reply, a status never: a task published
    with a ``Status`` header of its own is still a task (and answered or refused as one).
    """
    if msg.reply or not msg.headers:
        return None
    return msg.headers.get("Status")


def pull_request(expiry_s: float, heartbeat_s: float | None) -> bytes:
    """One message, expiring just before ``expiry_s`` (as nats.py's fetch), with the idle heartbeat asked for."""
    request = {"batch": 1, "expires": int(expiry_s * 1e9) - 100_000}
    if heartbeat_s is not None:
        request["idle_heartbeat"] = int(heartbeat_s * 1e9)
    return json.dumps(request).encode()


class TaskPull:
    """The worker's pull: bound to one consumer subscription at a time, it outlives a rebind.

    ``carried`` holds messages a cancelled read had already taken off a subscription's queue: the
    next pull hands them on first (their ack subjects stay valid across a rebind), a stop hands them
    back (:meth:`close`). Dropping one would leave it to JetStream's ack_wait (bench_fleet, a server
    restart at 5,000 nodes).
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.carried: list[Msg] = []
        self.heartbeats = 0  # idle heartbeats the server sent on our pulls (observability, tests)
        self._psub: JetStreamContext.PullSubscription | None = None

    # -- binding ------------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._psub is not None

    def bind(self, psub: JetStreamContext.PullSubscription) -> None:
        self._psub = psub

    @property
    def next_subject(self) -> str:
        """The consumer's ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` subject (what a pull is sent to)."""
        nms: str = self._bound()._nms
        return nms

    @property
    def deliver_subject(self) -> str:
        """The inbox the server delivers to (the reply subject of a pull request)."""
        deliver: str = self._bound()._deliver
        return deliver

    def queued(self) -> int:
        """Messages (tasks and statuses) delivered and not yet read."""
        return self._inbox()._pending_queue.qsize()

    async def unbind(self, timeout_s: float) -> None:
        """Unsubscribe (best effort); ``carried`` stays for the next binding."""
        psub, self._psub = self._psub, None
        if psub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await asyncio.wait_for(psub.unsubscribe(), timeout_s)

    async def close(self, timeout_s: float) -> list[Msg]:
        """Unsubscribe and return every task taken or delivered and not handed on (to be handed back).

        Unsubscribe first: the server then has no interest in this agent's waiting pull, so a task it
        would deliver meanwhile goes to the next agent at once; statuses left queued are dropped.
        """
        psub = self._psub
        await self.unbind(timeout_s)
        if psub is not None:
            queued = psub._sub._pending_queue
            while not queued.empty():
                msg = queued.get_nowait()
                if pull_status(msg) is None:
                    self.carried.append(msg)
        carried, self.carried = self.carried, []
        return carried

    # -- reading ------------------------------------------------------------------------

    async def request(self, expiry_s: float, heartbeat_s: float | None) -> None:
        """Send one pull request: to the consumer's next-message subject, answered on the inbox."""
        await self.nc.publish(self.next_subject, pull_request(expiry_s, heartbeat_s), self.deliver_subject)

    async def pull_one(self, expiry_s: float, heartbeat_s: float | None) -> list[Msg]:
        """One message by a pull that (with ``heartbeat_s``) asks the server for idle heartbeats, and notices when
        they stop.

        Raises :class:`PullSilent` after ``2 * heartbeat_s`` without a message or a status (unless our own
        connection is down: its reconnect ends the pull); ``nats.errors.TimeoutError`` when the pull
        expired (404/408, as ``fetch``); ``APIError`` for any other status (409: the consumer was deleted,
        a pull limit of the consumer).
        """
        if self.carried:
            return [self.carried.pop(0)]
        inbox = self._inbox()
        pending = inbox._pending_queue
        while not pending.empty():  # left from an earlier pull: a message is ours, a status was that pull's
            msg = pending.get_nowait()
            inbox._pending_size -= len(msg.data)
            if pull_status(msg) is None:
                return [msg]
        await self.request(expiry_s, heartbeat_s)
        loop = asyncio.get_running_loop()
        # The server counts the expiry from when it got the request: its 408 comes a little after ours would.
        # Waiting for it keeps it out of the next pull (taken there as that pull's end, it doubled the pulls
        # of 2,000 idle nodes under load: bench_fleet). The bound counts from the request, never from a
        # heartbeat: nats-server < 2.9.16 drops the 408 of a pull that expires as a message arrives (PR #3942;
        # seen in bench_fleet bursts), and that message then waits for our next pull, here <= 1 s.
        end = loop.time() + expiry_s + min(1.0, heartbeat_s or 1.0)
        last = loop.time()  # the last sign of life of this pull: its request, a heartbeat, a status
        while True:
            now = loop.time()
            if now >= end:
                raise nats.errors.TimeoutError  # expired without its 408: what fetch() raises too
            try:
                msg = await self.take((end if heartbeat_s is None else min(end, last + 2 * heartbeat_s)) - now)
            except nats.errors.TimeoutError:
                now = loop.time()
                if heartbeat_s is not None and now < end and now - last >= 2 * heartbeat_s:
                    if not self.nc.is_connected:  # the reconnect ends this pull (kick); nothing to tell
                        last = now
                        continue
                    raise PullSilent(now - last) from None
                continue
            status = pull_status(msg)
            if status is None:
                return [msg]
            last = loop.time()
            if status == "100":
                self.heartbeats += 1
                continue
            if status in ("404", "408"):
                raise nats.errors.TimeoutError
            headers = msg.headers or {}
            raise nats.js.errors.APIError(code=int(status) if status.isdigit() else None,
                                          description=headers.get("Description") or headers.get(Header.DESCRIPTION))

    async def take(self, timeout: float) -> Msg:
        """The next message of the subscription's queue within ``timeout`` (else ``nats.errors.TimeoutError``).

        Cancellation-safe, unlike nats.py's ``next_msg``: there the message is taken off the queue by an inner
        task, and a cancel (a kick at reconnect, a stop) that lands before the caller resumes drops it. Here
        a cancelled ``Queue.get`` leaves the message queued, and one already taken is carried to the next pull.
        """
        inbox = self._inbox()
        getter = asyncio.ensure_future(inbox._pending_queue.get())
        try:
            await asyncio.wait({getter}, timeout=max(timeout, 0.0))
        except asyncio.CancelledError:
            if getter.done() and not getter.cancelled():
                self.carried.append(getter.result())
                inbox._pending_size -= len(self.carried[-1].data)
            else:
                getter.cancel()
            raise
        if not getter.done():
            getter.cancel()
            raise nats.errors.TimeoutError
        msg: Msg = getter.result()
        inbox._pending_size -= len(msg.data)
        return msg

    def _bound(self) -> JetStreamContext.PullSubscription:
        if self._psub is None:
            raise RuntimeError("the pull is not bound to a consumer")
        return self._psub

    def _inbox(self) -> Subscription:
        inbox: Subscription = self._bound()._sub
        return inbox
