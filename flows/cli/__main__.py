"""`python -m flows.cli ...`, the same as the `rollflow` command."""

import sys

from flows.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
