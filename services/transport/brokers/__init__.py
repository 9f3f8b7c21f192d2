"""Brokers to run, not clients: Apache Kafka from Maven Central's jars (:mod:`.apache_kafka`, what ``streamppo up``
and the tests start) and the local in-process broker (:mod:`.local_broker`, where Java is missing)."""
