"""Everything the tests share, in one package; test modules import from here and never from
each other.

- `configs`: `arithmetic_config`, the run config every flow test starts from (the `make_config`
  fixture in tests/conftest.py wraps it), and `small_config` for configs that are only read.
- `fakes`: every fake: the actors a rollout step talks to, a model-free `StepModel`, a
  character tokenizer, object stores that count or fail, an HTTP reward model.
- `samples`: hand-built samples, prompt files, a torch backend, reference token statistics.
- `hooks`: hooks loaded by import string (`tests.support.hooks:NAME`): faults, filters, eval.
- `faults`: running a training with a fault fired mid-run.
- `procs`: subprocesses that run rollflow as a user's shell would.
- `prefect_ui`: what the Prefect UI shows of a run, read through its API.
- `servers`: the moto S3 server and the fault matrix of the session.
- `gpu`, `parity`: tiny Qwen2 models, GRPO samples and NCCL settings of the GPU tests; the
  torch-vs-megatron comparison.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
