"""A trainer that saves checkpoints until it is killed (`tests/integration/test_checkpoint_kill.py`):
the real `TrainActor` (torch backend, tiny model) in this process, no Ray.

Each start resumes as a rebuilt trainer does (`ensure_version` from the newest complete
checkpoint, checked against its manifest), saves that checkpoint again as a rerun's commit
does, then trains and saves one step after another. A line of JSON on stdout announces each
save (`saving`, with a digest of the weights being saved) and its end (`saved`). The weights
a start resumes from are nudged by an amount that depends on the start (`attempt`): a
rebuilt trainer need not be bit-identical to the one that saved, so a save repeated over an
existing checkpoint writes other bytes.

    python -m tests.support.checkpoint_writer

starts a zygote: it imports torch, transformers and rollflow once, then for each line of JSON
arguments on stdin (`main`'s) forks a writer, says `{"child": pid}`, and once the child is
gone (finished or killed by the test), `{"ended": pid, "status": ...}`. Ten starts then cost
ten forks, not ten Python start-ups.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time

import torch


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def say(**record: object) -> None:
    """One line of JSON in one write to stdout: a child killed mid-record leaves all of it or
    none, never a record without its newline (one ran into the zygote's next record in CI)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(record) + "\n").encode())


def main(runs_root: str, run: str, model_dir: str, data: str, attempt: int, steps: int,
         kill: tuple[int, str, float] | None = None) -> None:
    """Resume, save again, then train and save up to `steps`; with `kill` = (n, phase,
    seconds), SIGKILL this process during its n-th save (0: the repeated one): `save`."""
    from engines.train.train_actor import TrainActor
    from tests.support.configs import arithmetic_config
    from tests.support.samples import make_samples

    torch.set_num_threads(1)
    cfg = arithmetic_config(run_name=run, runs_root=runs_root, data={"train": data},
                            model_dir=model_dir, ray_address="unused", backend="embedded",
                            overrides=["train.save_interval=1", "train.lr=0.01"])
    actor = TrainActor(cfg)
    latest = actor.layout.latest_checkpoint()
    if latest is not None:
        actor.ensure_version(latest + 1)  # rebuilt from it, its files checked by sha256
    model = actor.backend.model
    say(resumed=latest, digest=weights_digest(model.state_dict()), version=actor.version())
    if latest is not None:  # a rerun's commit saves the checkpoint it resumed from again
        with torch.no_grad():
            next(model.parameters()).add_(1e-4 * attempt)
    for n, k in enumerate(range(0 if latest is None else latest, steps)):
        if k != latest:
            actor.backend.train(make_samples(8, seed=k), k)
        if save(actor, k, kill[1:] if kill is not None and kill[0] <= n else None):
            kill = None


def save(actor, k: int, kill: tuple[str, float] | None) -> bool:  # type: ignore[no-untyped-def]
    """Announce, save, and say how long the save took and when its files were staged
    locally (after that, they are being stored): the test aims its kills by these. `kill` =
    (phase, seconds): SIGKILL this process that long after the save ("save") or its storing
    ("store") began; returns whether it was armed (a checkpoint already stored whole is not
    saved again, so it has no storing). A timer, not the test's os.kill on reading this
    process's output: the pipe and a loaded machine would put the moment anywhere but where
    it was aimed."""
    backend_save, staged, armed = actor.backend.save_checkpoint, [0.0], [False]

    def arm(phase: str) -> None:
        if kill is not None and kill[0] == phase:
            threading.Timer(kill[1], os.kill, (os.getpid(), signal.SIGKILL)).start()
            armed[0] = True

    def timed(path: str) -> None:
        backend_save(path)
        staged[0] = time.perf_counter() - start
        arm("store")

    actor.backend.save_checkpoint = timed
    say(saving=k, digest=weights_digest(actor.backend.model.state_dict()))
    start = time.perf_counter()
    arm("save")
    try:
        actor.save_checkpoint(k)
    finally:
        actor.backend.save_checkpoint = backend_save
    say(saved=k, seconds=time.perf_counter() - start, staged=staged[0])
    return armed[0]


def zygote() -> None:
    import engines.train.torch_backend  # noqa: F401 - imported once, before forking
    import engines.train.train_actor  # noqa: F401
    import tests.support.configs  # noqa: F401
    import tests.support.samples  # noqa: F401

    torch.set_num_threads(1)
    say(ready=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                main(**json.loads(line))
            except BaseException as exc:  # noqa: BLE001 - reported to the test, then exit
                say(error=f"{type(exc).__name__}: {exc}")
                code = 1
            finally:
                os._exit(code)
        say(child=pid)
        _, status = os.waitpid(pid, 0)
        say(ended=pid, status=status)


if __name__ == "__main__":
    zygote()
