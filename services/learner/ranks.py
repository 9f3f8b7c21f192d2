"""The learner's ranks as processes: torch's launcher starts them, and this supervises the launcher.

With ``learner.parallel.processes`` > 1, ``streamppo learner`` runs that many ranks of this very command on its
machine under torch's launcher (``torch.distributed.run``); rank 0 leads (the service's lifecycle, the bus) and the
others follow it (:mod:`.parallel`). When a rank dies the launcher stops the others and exits; all ranks are
then started again by a new launcher (they resume from the last checkpoint), as :mod:`services.runtime.restarts` says,
after which the error is left to a supervisor (``streamppo up``, Kubernetes); rank 0's own answer (the log replaced, a
configuration error) is passed on as its exit code and not restarted. The launcher's own restarts are not used:
with gloo, ranks it restarts in place cannot connect to each other (torch 2.13). SIGTERM and SIGINT are passed on
to the launcher, which passes them to the ranks: rank 0 finishes its batch and checkpoints, and nothing restarts.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from common.config import RunConfig
from services.runtime.exit_codes import PASSED_ON
from services.runtime.restarts import RestartPolicy, Restarts
from services.service import ProcessGroup, Service

log = logging.getLogger(__name__)

__all__ = ["LearnerRanks"]


class LearnerRanks(ProcessGroup):
    def __init__(self, config: RunConfig):
        parallel = config.learner.parallel
        self.processes = parallel.processes
        self.policy = RestartPolicy(give_up_after=parallel.max_restarts)

    def launch(self) -> int | None:
        # The launcher sets these in every rank it starts.
        if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return None
        return self._supervise(
            [
                sys.executable,
                "-m",
                "services.learner.launcher",  # torch's launcher, reporting failed ranks in a line each
                "--standalone",
                f"--nproc-per-node={self.processes}",
                "--max-restarts=0",
                "-m",
                "services.cli",
                *sys.argv[1:],
            ]
        )

    def leads(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    def follow(self, service: Service) -> None:
        service.ranks.follow(service.trainer)

    def peer_gone(self, exc: BaseException) -> str | None:
        # gloo's error when the other end of a collective died (torch 2.13: a RuntimeError naming the connection).
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("closed by peer" in text or "reset by peer" in text):
            detail = text.split(". ")[0].rsplit("] ", 1)[-1]
            return f"rank {os.environ.get('RANK', '?')}: another rank is gone ({detail})"
        return None

    def _supervise(self, command: list[str]) -> int:
        # Each rank's share of the cores (the launcher would set 1 and say so).
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.processes))} | dict(os.environ)
        stopping, child = False, None

        def forward(signum, frame) -> None:
            nonlocal stopping
            stopping = True
            if child is not None and child.poll() is None:
                child.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        restarts = Restarts(self.policy)
        while True:
            log.info("starting %d ranks: %s", self.processes, " ".join(command))
            started = time.monotonic()
            child = subprocess.Popen(command, env=env)
            code = child.wait()
            # The run's own answer (e.g. the log replaced) is passed on, not restarted.
            if code == 0 or stopping or code in PASSED_ON:
                return code
            delay = restarts.after_exit(code, time.monotonic() - started)
            if delay is None:
                log.error("the ranks failed %d times in a row (exit %d); giving up", restarts.quick_failures, code)
                return code
            log.warning(
                "a rank failed (launcher exit %d); restarting all %d ranks in %.0f s (%d of %d)",
                code,
                self.processes,
                delay,
                restarts.quick_failures,
                self.policy.give_up_after,
            )
            time.sleep(delay)
