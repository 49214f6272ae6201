"""JetStream task worker: pull this node's tasks and hand each to the task policy; bind, kick, drain.

Two parts: the pull (control/pull.py, the one reader of nats.py's internals) and the task policy
(control/taskpolicy.py: replay, deadline, poison, run, crash, answer, as ordered named gates).
This module binds the consumer, runs the pull loop, admits or hands back what it pulled
(control/admission.py) and drains at a stop.

The consumer is the control plane's: it creates it (``control/consumer.py``) at enrollment and
again when its cluster member is lost, and the node may only look it up (``CONSUMER.INFO``), pull
(``MSG.NEXT``) and ack (docs/security-auth.md: whoever writes a consumer's body decides where the
server publishes). A consumer that is not there yet is waited for (``consumer_missing``). In one
shared account the stream is found by subject (``$JS.API.STREAM.NAMES``); with an account per node
(``js_api_prefix`` :data:`~gpuaas_agent.control.accounts.NODE_JS_API_PREFIX`) it is the node's own,
``GPUAAS_NODE_TASKS_<node>``, by name. A pull request waits
``fetch_timeout_s`` (30 s) on the server; liveness is the connection's PING and the
heartbeat, not a 1 s poll. :meth:`kick` (called on every reconnect) and :meth:`stop` end
the wait at once. Configured (``fetch_heartbeat_s``, config ``pull_heartbeat_s``; off by
default), the pull also asks the server for an idle heartbeat that often: the consumer's
server can be lost while ours is not (an R1 consumer on a cluster member that died), and
then no reconnect ends the pull. Two intervals
without a heartbeat (``pull_heartbeat_missed``) check the consumer: gone → bind again; no
answer for an R1 consumer (``consumer_leaderless``) → look it up again until the control plane has
created it on a member that is up (see :meth:`TaskWorker._check_served`). A 409 ending the pull
(``pull_ended_by_server``: Server Shutdown, Consumer Deleted) is followed by a new pull, paced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.tasks import TaskType
from gpuaas_agent.control.accounts import NODE_JS_API_PREFIX
from gpuaas_agent.control.admission import Admission, Refusal
from gpuaas_agent.control.pull import PullSilent, TaskPull
from gpuaas_agent.control.streams import task_stream_name
from gpuaas_agent.control.taskpolicy import TaskObserver, TaskPolicy, WorkerSettings
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.context import Handler

log = logging.getLogger(__name__)

_event = functools.partial(log_event, log)
_warn = functools.partial(log_event, log, level=logging.WARNING)


class ConsumerMissing(Exception):
    """Our consumer is not there (or not in the shape the control plane must create): wait for the control plane."""

    def __init__(self, stream: str, consumer: str, **found: Any) -> None:
        super().__init__(f"consumer {consumer} on {stream} is missing")
        self.stream, self.consumer, self.found = stream, consumer, found

class TaskWorker:
    """Build once in the daemon; :meth:`run` until :meth:`stop`; then :meth:`drain`.

    ``handlers``: every served type's handler; ``recoveries``: the recoveries the registry rows declare
    (``tasks/registry.build_tasks``), run for an interrupted task that will not run again. ``observer``
    (the daemon's metrics): ``task_finished`` per result stored, ``step_finished`` per pipeline step.
    """

    def __init__(self, nc: Client, store: StateStore | StoreThread, node_id: str, handlers: Mapping[TaskType, Handler],
                 settings: WorkerSettings | None = None, *, recoveries: Mapping[TaskType, Handler] | None = None,
                 observer: TaskObserver | None = None) -> None:
        self.nc = nc
        self.settings = settings or WorkerSettings()
        self.js = nc.jetstream(timeout=self.settings.request_timeout_s, prefix=self.settings.js_api_prefix)
        # Every SQLite call of the worker runs on the one store thread, off the event loop (state/aio.py):
        # a commit waiting for another process's write lock must not stop keepalives and heartbeats.
        self.state = as_store_thread(store)  # also what handlers get as ctx.store (they await it)
        self.node_id = node_id
        # A pulled task starts only with a free place of its class, type and allocation; else it holds nothing.
        self.admission = Admission(self.settings.concurrency,
                                   per_allocation=self.settings.interactive_per_allocation)
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # What happens to each admitted task (control/taskpolicy.py): its gates, its handler or its recovery.
        self.policy = TaskPolicy(nc=nc, js=self.js, state=self.state, node_id=node_id, handlers=handlers,
                                 recoveries=recoveries or {}, settings=self.settings, observer=observer,
                                 stopping=self._stopping)
        # The pull (control/pull.py, the one reader of nats.py's internals); it keeps a message a kicked or
        # stopped read had already taken (``carried``) across a rebind, to hand on or back.
        self.pull = TaskPull(nc)
        self._fetching: asyncio.Future[list[Msg]] | None = None
        self._checked_at = 0.0
        self._silent_pulls = 0  # pulls in a row that went silent (no heartbeat): paces the consumer checks
        self.pull_heartbeats_missed = 0  # pulls ended because their heartbeats stopped
        self.stream: str | None = None
        self.ready = asyncio.Event()
        listeners = getattr(nc, "reconnect_listeners", None)
        if listeners is not None:  # control/connection.py's client: a reconnect ends the current pull
            listeners.append(self.kick)

    @property
    def subject_filter(self) -> str:
        return subjects.tasks(self.node_id)

    @property
    def pull_heartbeats(self) -> int:
        """Idle heartbeats the server sent on our pulls (observability, tests)."""
        return self.pull.heartbeats

    @property
    def running_task_ids(self) -> list[str]:
        return sorted(self.policy.inflight)

    # -- lifecycle ----------------------------------------------------------------

    async def _bind(self) -> JetStreamContext.PullSubscription:
        """Find the stream, look our consumer up (the control plane creates it), bind the pull to it."""
        name = self.settings.durable_name(self.node_id)
        stream = self.settings.task_stream
        if stream is None and self.settings.js_api_prefix == NODE_JS_API_PREFIX:
            # An account per node: its task stream is its own by name (control/streams.py), and the account
            # imports no stream listing (it would name every node of the fleet, and cost a scan of 2 N streams
            # per bind).
            stream = task_stream_name(self.node_id)
        if stream is None:
            stream = await self.js.find_stream_name_by_subject(self.subject_filter)
        self.stream = stream
        try:
            info = await self.js.consumer_info(stream, name, timeout=self.settings.request_timeout_s)
        except nats.js.errors.NotFoundError:
            raise ConsumerMissing(stream, name) from None
        if info.config.filter_subject != self.subject_filter or info.config.deliver_subject:
            # Not the shape the control plane must create (control/consumer.py): pulling from it would take
            # tasks not ours, or race a push delivery. Waited out like a missing one, loudly.
            raise ConsumerMissing(stream, name, filter_subject=info.config.filter_subject,
                                  deliver_subject=info.config.deliver_subject)
        return await self.js.pull_subscribe_bind(name, stream=stream)

    def kick(self) -> None:
        """End the pull that is waiting now (a reconnect lost it on the server): the next one starts at once."""
        if self._fetching is not None and not self._fetching.done():
            self._fetching.cancel()

    async def _fetch(self) -> list[Msg] | None:
        """One pull (:meth:`TaskPull.pull_one`); None when :meth:`stop` or :meth:`kick` ended it first."""
        fetching = self._fetching = asyncio.ensure_future(
            self.pull.pull_one(self.settings.fetch_timeout_s, self._pull_heartbeat_s()))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({fetching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not fetching.done():
                fetching.cancel()
            self._fetching = None
        if fetching.cancelled():
            return None
        if not fetching.done():  # cancelled just now: let it unwind (an outer cancel still reaches us)
            await asyncio.wait({fetching})
            if not fetching.cancelled() and fetching.exception() is None:
                self.pull.carried.extend(fetching.result())  # it got a task as it was ended: handed on, or back at stop
            return None
        return fetching.result()

    def _pull_heartbeat_s(self) -> float | None:
        """The idle heartbeat to ask for; None when off or too long to tell anything within one pull."""
        heartbeat = self.settings.fetch_heartbeat_s
        if heartbeat is None or heartbeat <= 0 or 2 * heartbeat >= self.settings.fetch_timeout_s:
            return None
        return heartbeat

    async def _pull_went_silent(self, silent_s: float) -> None:
        """A pull's heartbeats stopped while our connection is up: check the consumer, then pull again.

        Silent pulls in a row are paced (bounded backoff), so a server that never sends heartbeats
        costs one pull and one check per interval, never a spin.
        """
        self.pull_heartbeats_missed += 1
        self._silent_pulls += 1
        _warn("pull_heartbeat_missed", consumer=self.settings.durable_name(self.node_id), stream=self.stream,
              silent_s=round(silent_s, 2), in_a_row=self._silent_pulls)
        await self._check_served()
        if self._silent_pulls > 1:
            await self._pause(min(0.2 * 2 ** (self._silent_pulls - 2), 5.0))

    async def _check_served(self) -> None:
        """Our pull was lost on the server (its heartbeats stopped, or a bind got no answer): is the consumer served?

        - answered: its server lost the pull (a restart, a leader change): pull again;
        - not found: bind again (the bind looks it up until the control plane has created it);
        - no answer, and the consumer is R1: its only server is gone, and with it the consumer (a
          memory consumer's state). Nothing answers for it until the control plane deletes it and
          creates it again on a member that is up (it notices the lost member itself); bind again,
          which looks it up until then. The work queue kept the tasks; one running here is
          redelivered and answered from the stored result (``task_redelivered_while_running``);
        - no answer otherwise (a replicated consumer electing a leader, a busy server), or our own
          connection dropped meanwhile (the reconnect renews the pull): pull again.
        """
        consumer = self.settings.durable_name(self.node_id)
        self._checked_at = asyncio.get_running_loop().time()
        reconnects = self.nc.stats.get("reconnects")
        # A probe: a served consumer answers at once; no answer within two heartbeats is the answer.
        heartbeat = self._pull_heartbeat_s()
        timeout = self.settings.request_timeout_s if heartbeat is None else min(self.settings.request_timeout_s,
                                                                                2 * heartbeat)
        assert self.stream is not None  # bound before the first pull
        try:
            await self.js.consumer_info(self.stream, consumer, timeout=timeout)
        except nats.js.errors.NotFoundError:
            _warn("consumer_missing", consumer=consumer, stream=self.stream, rebind=True)
            await self._unbind()
        except (nats.errors.Error, TimeoutError) as exc:
            still_connected = self.nc.is_connected and self.nc.stats.get("reconnects") == reconnects
            if self.settings.consumer_replicas == 1 and still_connected and not self._stopping.is_set():
                _warn("consumer_leaderless", consumer=consumer, stream=self.stream, error=repr(exc),
                      waiting_for="the control plane to create it again")
                await self._unbind()

    async def run(self) -> None:
        """Pull and dispatch until :meth:`stop`. Connection trouble is logged and retried, never fatal."""
        backoff = 0.2
        while not self._stopping.is_set():
            if not self.pull.bound:
                try:
                    self.pull.bind(await self._bind())
                    self._checked_at = asyncio.get_running_loop().time()
                    self.ready.set()
                    _event("worker_ready", node_id=self.node_id, consumer=self.settings.durable_name(self.node_id))
                    backoff = 0.2
                except ConsumerMissing as exc:
                    _warn("consumer_missing", consumer=exc.consumer, stream=exc.stream, retry_in_s=backoff,
                          waiting_for="the control plane to create it", **exc.found)
                    await self._pause(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                except (nats.errors.Error, TimeoutError) as exc:
                    _warn("consumer_bind_failed", error=repr(exc), retry_in_s=backoff)
                    await self._pause(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
            if not self.admission.any_free():  # lifecycle and interactive both full: pull nothing
                await asyncio.wait(self._tasks, timeout=self.settings.fetch_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                # One message per pull: nats.py's batch fetch holds a first message until the batch fills
                # or the pull expires (measured: up to the whole 30 s expiry); one is handed on at once.
                msgs = await self._fetch()
            except (nats.errors.TimeoutError, TimeoutError):
                self._silent_pulls = 0  # the pull lived to its expiry: the server answered it
                await self._check_consumer()
                continue
            except PullSilent as exc:
                await self._pull_went_silent(exc.silent_s)
                continue
            except (nats.js.errors.APIError, nats.errors.NoRespondersError) as exc:
                if getattr(exc, "code", None) == 409:
                    # The server ended our pull (409 Server Shutdown: the consumer's member stops; Consumer
                    # Deleted; a pull limit of the consumer): pull again, paced. If nobody serves the consumer
                    # now, that pull's heartbeats never come and the heartbeat check finds out why; checking at
                    # once would ask a member that is still going down (or coming back: a restart).
                    _warn("pull_ended_by_server", status=409, description=exc.description,  # type: ignore[union-attr]  # a 409 is an APIError
                          retry_in_s=backoff)
                    await self._pause(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                # The consumer is gone (deleted, a memory consumer after a server restart): bind again,
                # which waits for the control plane to create it; the work queue kept its tasks.
                _warn("fetch_failed", error=repr(exc), retry_in_s=backoff, rebind=True)
                await self._unbind()
                await self._pause(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except nats.errors.Error as exc:
                _warn("fetch_failed", error=repr(exc), retry_in_s=backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if msgs is None:
                continue
            backoff = 0.2
            self._silent_pulls = 0
            for msg in msgs:
                ticket = self.admission.admit(msg.subject, msg.data)
                if isinstance(ticket, Refusal):  # it may not start now: it holds nothing here
                    task = asyncio.create_task(self.policy.turn_away(msg, ticket))
                else:
                    task = asyncio.create_task(self.policy.process(msg))
                    # mypy cannot infer a lambda whose default argument binds this ticket: hence its ignore
                    task.add_done_callback(lambda _t, ticket=ticket: self.admission.release(ticket))  # type: ignore[misc]
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _check_consumer(self) -> None:
        """Every ``consumer_check_s`` of empty pulls: does our consumer still exist? If not, bind again.

        A pull on a deleted consumer (inactive_threshold, an operator, a memory consumer after a
        server restart) is simply never answered, which looks exactly like "no task".
        """
        loop = asyncio.get_running_loop()
        if not self.pull.bound or loop.time() - self._checked_at < self.settings.consumer_check_s:
            return
        self._checked_at = loop.time()
        assert self.stream is not None  # bound with the subscription
        try:
            await self.js.consumer_info(self.stream, self.settings.durable_name(self.node_id),
                                        timeout=self.settings.request_timeout_s)
        except nats.js.errors.NotFoundError:
            _warn("consumer_missing", consumer=self.settings.durable_name(self.node_id), stream=self.stream, rebind=True)
            await self._unbind()
        except (nats.errors.Error, TimeoutError):
            pass  # the server is busy or away: the connection's own PINGs and reconnects deal with that

    async def _unbind(self) -> None:
        await self.pull.unbind(self.settings.request_timeout_s)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def stop(self) -> None:
        """Stop pulling new tasks (running ones go on; see :meth:`drain`)."""
        self._stopping.set()

    async def drain(self, grace_s: float) -> list[str]:
        """Let running tasks finish for up to ``grace_s``; cancel the rest (unacked: redelivered later).

        Returns the task ids that were cancelled.
        """
        self.stop()
        # Unsubscribe first: the server then has no interest in this agent's waiting pull, so a task it
        # would deliver during the grace, or one a cancelled handler hands back below (nak), goes to the
        # next agent at once instead of into this exiting process (redelivered only ack_wait_s later).
        # Also before the connection drains, or drain() hangs on the pull inbox. Tasks the stopped pull
        # had already taken (carried) or left queued: handed back now, not at ack_wait.
        carried = await self.pull.close(self.settings.request_timeout_s)
        for msg in carried:
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await asyncio.wait_for(msg.nak(), self.settings.request_timeout_s)
            _warn("task_handed_back_at_stop", subject=msg.subject, before_start=True)
        cancelled: list[str] = []
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            cancelled = self.running_task_ids
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=self.settings.cancel_settle_s + self.settings.request_timeout_s)
                _warn("tasks_cancelled_at_shutdown", task_ids=cancelled)
        return cancelled
