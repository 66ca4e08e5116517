"""torch's launcher (``torch.distributed.run``) for a sharded learner's ranks, as the trainer node's process.

``python -m aurora.rl.learners.launch ARGS`` is ``torchrun ARGS``, except that a stop the node was
asked for (SIGTERM or SIGINT, as ``aurora run`` and Ctrl-C send them) ends it with status 0 once the
launcher has stopped the ranks, not with the launcher's traceback. A rank that fails is still the
launcher's to handle: it starts every rank again (``--max-restarts``), then fails with its report.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


def run(argv: Sequence[str]) -> int:
    try:
        main(list(argv))
    except SignalException as e:
        if e.sigval in (signal.SIGTERM, signal.SIGINT):
            return 0
        raise
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
