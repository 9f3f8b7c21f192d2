"""torch's launcher for the learner's ranks (``python -m services.learner.launcher``, torchrun's arguments), saying
what failed as the services do: one line per failed rank instead of torchrun's report, and the exit code a
supervisor acts on. Rank 0's code when it says more than "failed" (the log replaced, a configuration error, a full
disk: :data:`services.runtime.exit_codes`), else 1.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from services.runtime.exit_codes import ERROR, OK, PASSED_ON

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            code = failure.exitcode
            how = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
            print(f"learner rank {rank} ended: {how}", file=sys.stderr, flush=True)
        leader = exc.failures.get(0)
        return leader.exitcode if leader is not None and leader.exitcode in PASSED_ON else ERROR
    return OK


if __name__ == "__main__":
    sys.exit(main())
