"""Broker integrations: consumer wrappers that claim before the handler and ack after it.

- :mod:`dedupcore.integrations.rabbitmq` - pika and aio-pika consumers.
- :mod:`dedupcore.integrations.nats` - NATS JetStream pull consumers.
- :mod:`dedupcore.integrations.kafka` - a confluent-kafka consumer loop.
"""
