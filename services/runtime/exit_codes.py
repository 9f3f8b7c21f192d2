"""Exit codes of ``streamppo`` commands: what a supervisor (``streamppo up``, Kubernetes) may restart."""

OK = 0
ERROR = 1  # any other failure: a broker that stays away, a crash
CONFIG = 2  # a bad setting or argument, or what one names that cannot be had (a prompt file, a reward function, a
# model folder): a restart cannot cure it
NO_SPACE = 3  # a disk without room for a checkpoint or snapshot: neither can a restart
LOG_REPLACED = 4  # the log the service worked on is gone (the broker lost its data): resume the run on the new log
RUN_SHORT = 5  # the run finished before run.steps updates (its prompt batches used up): the learner's log, the done:
# line and summary.json say why and which setting applies; a restart would end it short again
INTERRUPTED = 130

PERMANENT = {CONFIG: "a configuration error", NO_SPACE: "no space left on a disk"}
# What a process's own supervisor (the learner's rank launcher) passes on instead of restarting it: the answer is the
# run's (resume on the new log) or the user's to give.
PASSED_ON = {LOG_REPLACED, RUN_SHORT, *PERMANENT}
