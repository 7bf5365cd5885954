"""Broker integrations: consumer wrappers that claim before the handler and ack after it.

- :mod:`dedupcore.integrations.rabbitmq` - ``DedupConsumer`` (pika) and
  ``AsyncDedupConsumer`` (aio-pika).
- :mod:`dedupcore.integrations.nats` - NATS JetStream pull consumers
  (:class:`~dedupcore.integrations.nats.JetStreamConsumer`).
- :mod:`dedupcore.integrations.kafka` - a confluent-kafka consumer loop
  (:class:`~dedupcore.integrations.kafka.KafkaDedupLoop`); tested against a
  stand-in consumer, not a real broker.

Every wrapper takes either a claim store (:class:`~dedupcore.DedupStore`,
:class:`~dedupcore.Client`, :class:`dedupcore.aio.Client` for the asyncio
ones, the Redis and SQL tiers) or a ``TransactionalTable`` (the dedup row
commits in the business database's transaction, so a consumer killed
between that commit and the ack is safe: the redelivery is a DUPLICATE).
The contract, per delivery:

==================  =================================================================
claim outcome       what the wrapper does
==================  =================================================================
NEW                 handler, then complete (store) or commit (table), then ack
DUPLICATE           ack; the handler is not called
IN_PROGRESS         RabbitMQ: ``basic_nack(requeue=True)`` after ``retry_delay``;
                    NATS: ``nak(delay=retry_delay)``; Kafka: pause the partition and
                    seek back to the message for ``retry_delay``
handler raised      release the claim (table: roll back), then as IN_PROGRESS
                    (RabbitMQ with ``failure_requeue=False``: nack to the dead-letter
                    exchange)
no usable key       RabbitMQ: ``basic_reject(requeue=False)``; NATS: ``term()``;
                    Kafka: ``on_invalid``, else ``MissingKeyError``
store unavailable   as IN_PROGRESS: never run the handler on an undecided claim
==================  =================================================================

Giving up on a message after N failed deliveries is the broker's job:
RabbitMQ quorum queues with ``x-delivery-limit`` and a dead-letter exchange,
JetStream ``max_deliver`` with its MAX_DELIVERIES advisory.

The pieces every wrapper shares are importable from here: :class:`Delivery`,
:class:`TransactionalTable`, :func:`derive_key`, :class:`MissingKeyError`,
:class:`Verdict`, and :class:`ConsumerOptions` (the keywords the per-message consumers
share). Importing them needs no broker client library.
"""

from dedupcore.integrations._common import (
    ConsumerOptions,
    Delivery,
    MissingKeyError,
    TransactionalTable,
    Verdict,
    derive_key,
)

__all__ = [
    "ConsumerOptions",
    "Delivery",
    "MissingKeyError",
    "TransactionalTable",
    "Verdict",
    "derive_key",
]
