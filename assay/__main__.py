"""`python -m assay` (and `torchrun -m assay`) run the CLI."""

import sys

from assay.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
