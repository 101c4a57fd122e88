"""The `rollflow` command line (commands.py, `main`) and how it reports a failure (errors.py):
the top of flows/, which nothing else in rollflow imports."""

from flows.cli.commands import main

__all__ = ["main"]
