"""`python -m redwood …`: the CLI, as `torchrun --nproc_per_node N -m redwood generate …` launches it (every process a
tensor-parallel rank; rank 0 prints)."""

import os
import sys

from redwood.cli import main


def _end_torchrun_rank(status: int) -> None:
    """A torchrun rank ends without the interpreter's teardown, as every other rank does (`tp_launch._end_rank`,
    `parallel.launch`): its group's other ranks released first, then `os._exit`. The teardown would destroy gloo's
    threads still joinable — after `redwood serve` drained, rank 0 aborted there ("terminate called without an
    active exception")."""
    from redwood.engine.tp_worker import close_drivers

    close_drivers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    status = main()
    from redwood.parallel import launch

    if (launch.torchrun_world() or 1) > 1:
        _end_torchrun_rank(status)
    sys.exit(status)
