"""train.deterministic: kill -9 the driver at a random moment (seeded, printed), run the same
command again, kill it again at a later one, run it again, and the run ends with the weights and the rollout log-probs of an
uninterrupted run, bit for bit; so does a second uninterrupted run of the same config. Every
run goes with a CPU burner beside it (and the other xdist workers' tests): the guarantee is
for a busy machine. (This untrained model's runs did not differ on the code before the
trainer's deterministic kernels: tests/integration/test_trainer_under_load.py is the test
that fails there.)"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flows.config.loader import dump_config
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.procs import cpu_burner, start_driver

# Main-job-like steps: several decode batches a step, two optimizer steps per pass, the
# machine's threads; a kill lands in generation, training or a commit as often as not.
SETTINGS = (
    "train.deterministic=true", "rollout.num_rollout=3", "rollout.rollout_batch_size=16",
    "rollout.n_samples_per_prompt=8", "rollout.use_router=false", "cluster.actor_num_threads=null",
    "train.global_batch_size=64", "train.num_epochs_per_rollout=2",
)
_REFERENCE: dict[str, Any] = {}


def files_written(layout: RunLayout) -> int:
    """How far a run has got: the files in its directory (steps, journals, records,
    checkpoints), which a kill point counts in, so that it lands where it should under any
    machine load."""
    return sum(len(files) for _, _, files in os.walk(layout.uri))


def drive(config: Any, tmp_path: Path, prefect_api: str,
          kills: Sequence[tuple[int, float]] = ()) -> RunLayout:
    """Run `rollflow train` on `config`; each of `kills` (files, seconds): kill -9 the driver
    that many seconds after the run directory holds that many files, then run it again."""
    path = tmp_path / f"{config.storage.run_name}.yaml"
    path.write_text(dump_config(config))
    layout = RunLayout.open(config.storage.uri, config.storage.run_name)
    driver = start_driver(str(path), prefect_api)
    for files, seconds in kills:
        while files_written(layout) < files:
            assert driver.poll() is None, driver.communicate()[0]
            time.sleep(0.01)
        time.sleep(seconds)
        assert driver.poll() is None, "the run ended before the kill: nothing was tested"
        driver.send_signal(signal.SIGKILL)
        driver.communicate()
        print(f"killed with steps {layout.committed_steps()} committed")
        driver = start_driver(str(path), prefect_api)
    out, _ = driver.communicate(timeout=400)
    assert driver.returncode == 0, out
    return layout


def final_weights(layout: RunLayout) -> dict[str, torch.Tensor]:
    last = Path(layout.uri) / "checkpoints" / layout.store.read_text("checkpoints", "LATEST").strip().zfill(6)
    return {f"{f.name}:{k}": t for f in sorted(last.rglob("*.safetensors"))
            for k, t in load_file(f).items()}


def rollouts(layout: RunLayout) -> list[tuple[Any, ...]]:
    return [(s.index, s.tokens, s.reward, s.loss_mask, torch.tensor(s.rollout_log_probs))
            for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "rollout.arrow")]


@pytest.mark.timeout(900)
# None: a second uninterrupted run, which must equal the first as much as a resumed one does.
# A seed kills its run twice, the second time in the rerun (its start and resume included), at
# no cost of a run of its own.
@pytest.mark.parametrize("seed", [1, None], ids=["kill-twice", "uninterrupted"])
def test_kill_9_of_the_driver_anywhere_then_rerun_is_bit_identical(
    prefect_api, make_config, tmp_path, fault_matrix, seed
):
    if not _REFERENCE:  # (one uninterrupted run for every seed)
        with cpu_burner():
            ref = drive(make_config("ref", *SETTINGS, backend="embedded"), tmp_path,
                        prefect_api)
        _REFERENCE.update(files=files_written(ref), weights=final_weights(ref),
                          rollouts=rollouts(ref))
    kills = []
    if seed is not None:
        rng = random.Random(seed)
        kills = sorted((rng.randint(1, _REFERENCE["files"] - 2), rng.uniform(0.0, 0.5))
                       for _ in range(2))
        print(f"seed {seed}: kill -9 " + ", then ".join(
            f"{s:.2f} s after file {f} of {_REFERENCE['files']}" for f, s in kills))
    with cpu_burner():
        run = drive(make_config("kill", *SETTINGS, backend="embedded"), tmp_path, prefect_api,
                    kills)

    got, want = rollouts(run), _REFERENCE["rollouts"]
    samples_same = [g[:4] for g in got] == [w[:4] for w in want]
    logprobs_same = samples_same and all(torch.equal(g[4], w[4]) for g, w in zip(got, want, strict=True))
    weights, ref_weights = final_weights(run), _REFERENCE["weights"]
    weights_same = weights.keys() == ref_weights.keys() and all(
        torch.equal(weights[k], ref_weights[k]) for k in weights)
    fault, recovery = (
        (f"kill -9 of the driver at two random moments (seed {seed}), the second in the "
         "rerun, train.deterministic", "rerun of the same command, each time") if seed is not None else
        ("none: a second run of the same config, train.deterministic", "none needed"))
    fault_matrix.add(fault, recovery,
                     "final weights and rollout log-probs bit-identical",
                     samples_same and logprobs_same and weights_same)
    assert samples_same and logprobs_same, "tokens, rewards, loss masks or log-probs differ"
    assert weights_same, max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
