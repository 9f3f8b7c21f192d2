"""How replicas are hosted: one process each over Kafka (:mod:`.process`), every role in one process
(:mod:`.embedded`), several runs in one replica (:mod:`.fleet`), the processes of a run and its broker (:mod:`.cluster`,
``streamppo up``), with the restart policy, exit codes and the checks made before anything starts."""
