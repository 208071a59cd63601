"""`python -m redwood …`: the CLI, as `torchrun --nproc_per_node N -m redwood generate …` launches it (every process a
tensor-parallel rank; rank 0 prints)."""

import sys

from redwood.cli import main

if __name__ == "__main__":
    sys.exit(main())
