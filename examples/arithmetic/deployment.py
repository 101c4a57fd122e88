"""The Prefect pull step of `prefect.yaml`'s arithmetic deployments: the example's datasets
and tiny model, made on first use, so a "Quick run" from the UI works on a fresh checkout.

It runs in the flow run's process after `set_working_directory` moved it to the repo root,
so the paths below are the ones the deployments' config names (relative to that root).
Both builders are idempotent: an existing dataset (same arguments) or model is reused, and
the sizes are the main job's (`examples/arithmetic/run.py`), so the two share one copy.
"""

from __future__ import annotations

import os

from examples.arithmetic.build_model import save_tiny_model
from examples.arithmetic.make_data import write_datasets


def prepare_example(directory: str = "examples/arithmetic/artifacts") -> dict[str, str]:
    """Returns the files' paths (Prefect makes a step's dict available to later steps)."""
    data = write_datasets(os.path.join(directory, "data"), n_train=4000, n_test=500, n_sft=1000)
    return {**data, "model": save_tiny_model(os.path.join(directory, "tiny-llama"))}
