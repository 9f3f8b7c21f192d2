"""The delivery runtime every role shares: a replica's life (:mod:`.replica`), the runner that moves its records
(:mod:`.runner`) and its parts (intake and dead letters, sending, offsets, held input, streaming, the log watch,
status, the weights feed, batches by reference, the memory of handled keys, metrics)."""

from services.runtime.log_watch import LOG_CHECK_S
from services.runtime.replica import Replica
from services.runtime.runner import ServiceRunner, consumer_group

__all__ = ["LOG_CHECK_S", "Replica", "ServiceRunner", "consumer_group"]
