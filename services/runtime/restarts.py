"""When a failed process is started again, and when to give up: one policy for ``streamppo up`` (each child) and for a
multi-process replica (the learner's ranks).

A process that fails soon after its start (within ``quick_failure_s``) counts toward giving up; one that ran longer
starts the count again, since its failure says nothing about the next start. After ``give_up_after`` quick failures
in a row the failure is not transient (a model that cannot load): restarting stops. A process killed by a signal (an
operator, the OOM killer) is restarted however often: only its own errors can show that restarting is pointless.
The pause before a restart grows with the count, as Kubernetes' back-off does; the first restart is at once: a
replica of a role that has one costs the pipeline its start time and nothing more (benchmarks/RESULTS.md, 7).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestartPolicy", "Restarts"]


@dataclass(frozen=True)
class RestartPolicy:
    delays_s: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 30)
    quick_failure_s: float = 60.0
    give_up_after: int = 5


class Restarts:
    """The restarts of one process under a :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()):
        self.policy = policy
        self.quick_failures = 0

    def after_exit(self, code: int, ran_s: float) -> float | None:
        """The pause before starting again a process that exited with ``code`` (negative: killed by that signal)
        after running ``ran_s`` seconds; None to give up."""
        policy = self.policy
        self.quick_failures = self.quick_failures + 1 if ran_s < policy.quick_failure_s else 1
        if code > 0 and self.quick_failures > policy.give_up_after:
            return None
        return policy.delays_s[min(self.quick_failures, len(policy.delays_s)) - 1]
