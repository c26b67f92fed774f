"""The worker's Celery consumer: the redacting consumer, made to outlive a broker restart
and a full broker.

Celery 5.7 handles a lost broker connection by collecting it (``Connection.collect``: the
channels are closed where possible and the transport is detached) and then closing it. On
Redis, collecting a connection whose consumer was blocked in BRPOP fails half way: the
channel's close reads the dead socket first, raises, and stays open, and the connection
keeps it as its default channel. The close that follows closes that channel again; it
tries to put the worker's unacknowledged messages back through the detached transport and
raises an ``AttributeError``, which Celery takes for an unrecoverable error: the worker
exits on every broker restart that finds a task in flight and the consumer waiting for
more (tests/e2e/test_broker_restart.py).

``BrokerRestartConsumer`` forgets the default channel once the connection is collected,
so the close has nothing left to close twice. The messages the worker held stay in
Redis' unacknowledged set and are delivered again after the visibility timeout, as they
are when a collect fails on Celery 5.6.

A full Redis (maxmemory reached under noeviction) answers reads and refuses writes with
``OutOfMemoryError``, a ``ResponseError`` kombu counts as a channel error, which Celery
does not recover from: the worker exited. Worse, kombu pops a message (BRPOP) and then
records it as unacknowledged (``QoS.append``: ZADD and HSET); when Redis refuses that, the
message is in no queue and in no unacknowledged set. Here a full broker is a lost
connection (the consumer reconnects, with a growing pause, and says why), the message
whose recording was refused is kept in this process and handed back to the front of its
queue before the consumer takes anything again (tests/e2e/test_broker_full.py). A worker
killed while it holds one loses it: Redis must have the memory it needs (README).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis
from celery.utils.log import get_logger

from tasks.broker_words import OutOfMemoryError, broker_full, out_of_memory
from tasks.redaction import RedactingConsumer

log = get_logger("leasekeeper.worker")
# (payload, exchange, routing key) of messages popped from a full broker and not recorded
# as taken: handed back by the next connection (the consumer runs in the main process).
_held: list[tuple[dict[str, Any], str, str]] = []
FULL_PAUSE_MAX_S = 8.0
FULL_STREAK_RESET_S = 60.0


class BrokerRestartConsumer(RedactingConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A full Redis is recovered from as a lost connection is (Consumer.start).
        recoverable: tuple[type[BaseException], ...] = self.conninfo.connection_errors
        self.connection_errors = (*recoverable, OutOfMemoryError)
        self._full_streak = 0
        self._full_at = float("-inf")

    def connect(self) -> Any:
        """Celery's connect, the held messages handed back first (else it raises: the
        broker is still full, and the consumer tries again) and the task channel's
        recording guarded."""
        conn = self.connection_for_read(heartbeat=self.amqheartbeat)
        try:
            channel = conn.default_channel
            hand_back(channel)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that matters is re-raised
                conn.close()
            raise
        hold_what_a_full_broker_refuses(channel, self.app.conf.broker_url)
        if self.hub:
            conn.transport.register_with_event_loop(conn.connection, self.hub)
        return conn

    def on_connection_error_before_connected(self, exc: BaseException) -> None:
        if out_of_memory(exc):
            self._pause_while_full()
        else:
            super().on_connection_error_before_connected(exc)

    def on_connection_error_after_connected(self, exc: BaseException) -> None:
        connection = self.connection
        if connection is not None:
            collect = connection.collect

            def collect_then_forget_the_channel(*args: Any, **kwargs: Any) -> None:
                try:
                    collect(*args, **kwargs)
                finally:
                    # kombu's Connection keeps the channel a failed collect left open;
                    # the transport it needs for closing is gone.
                    connection._default_channel = None

            connection.collect = collect_then_forget_the_channel
        super().on_connection_error_after_connected(exc)
        if out_of_memory(exc):
            self._pause_while_full()

    def _pause_while_full(self) -> None:
        now = time.monotonic()
        if now - self._full_at > FULL_STREAK_RESET_S:
            self._full_streak = 0
        self._full_at = now
        pause = min(2.0 ** self._full_streak, FULL_PAUSE_MAX_S)
        self._full_streak += 1
        held = f"; {len(_held)} task(s) held to hand back" if _held else ""
        log.error("%s (next try in %g s%s)", broker_full(
            self.app.conf.broker_url, sending=False,
            then="and the worker takes tasks again: it takes none until Redis takes writes"),
            pause, held)
        time.sleep(pause)


def hold_what_a_full_broker_refuses(channel: Any, url: str) -> None:
    """Wrap the channel's ``qos.append`` (kombu records a popped message as taken): a
    message Redis refuses to record for want of memory is kept, to hand back."""
    qos = channel.qos
    append = qos.append

    def append_or_hold(message: Any, delivery_tag: Any) -> None:
        try:
            append(message, delivery_tag)
        except redis.exceptions.ResponseError as exc:
            if not out_of_memory(exc):
                raise
            info = message.delivery_info
            _held.append((message._raw, info["exchange"], info["routing_key"]))
            headers = message.headers or {}
            log.error("task %s[%s] was taken from its queue but Redis refused to record it "
                      "as taken: %s", headers.get("task"), headers.get("id"), broker_full(
                          url, sending=False, then="and this worker hands the task back to "
                          "its queue (it holds it until then)"))
            raise

    qos.append = append_or_hold


def hand_back(channel: Any) -> None:
    """Put the held messages back at the front of their queues (where BRPOP takes next),
    oldest first; raises OutOfMemoryError, keeping the rest, while Redis is still full."""
    while _held:
        payload, exchange, routing_key = _held[0]
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline()
            channel._do_restore_message(payload, exchange, routing_key, pipe, False)
            pipe.execute()
        _held.pop(0)
        headers = payload.get("headers") or {}
        log.warning("task %s[%s], held while the broker was full, is back in its queue",
                    headers.get("task"), headers.get("id"))
