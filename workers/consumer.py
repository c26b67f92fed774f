"""The worker's Celery consumer: the redacting consumer, made to outlive a broker restart.

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
"""

from __future__ import annotations

from typing import Any

from tasks.redaction import RedactingConsumer


class BrokerRestartConsumer(RedactingConsumer):
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
