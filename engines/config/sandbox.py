"""`rollout.sandbox`: how `rm_type: code_tests` runs the model's programs
(engines/sandbox/bubblewrap.py) and turns their tests into a reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from storage.config import Section


class SandboxConfig(Section):
    reward: Literal["pass_fraction", "all_pass"] = Field(
        "pass_fraction",
        description="pass_fraction: the share of a sample's tests that pass; all_pass: 1 when "
        "every test passes, else 0. A program the sandbox killed (time, output) keeps the "
        "tests that passed before.",
    )
    wall_s: float = Field(10.0, gt=0.0, description="Wall-clock deadline of one program, "
                          "its tests included; past it the whole sandbox is killed.")
    cpu_s: int = Field(5, ge=1, description="CPU seconds of the program (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=64, description="Address space of each process inside.")
    max_processes: int = Field(16, ge=2, description="Processes and threads inside at once.")
    max_output_kb: int = Field(1024, ge=1, description="stdout and stderr, each; past it the "
                               "program is killed.")
    scratch_mb: int = Field(16, ge=1, description="Size of the writable /scratch and /tmp.")
    max_concurrent: int = Field(
        2, ge=1, description="Programs run at once per rollout actor (about the cores it has).")
    python: str | None = Field(
        None, description="Interpreter the programs run with (default: the one behind this "
        "process's, by its real path: the standard library, not the run's packages).")
