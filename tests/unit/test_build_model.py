"""`python -m examples.arithmetic.build_model`: a tiny model of each family the docs name, with
the context it is asked for, written where it is told (its default does not depend on the
directory the command runs from)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig

from examples.arithmetic.build_model import DEFAULT_OUT
from tests.support import REPO_ROOT


def test_a_qwen2_with_a_long_context_goes_where_it_is_told(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.arithmetic.build_model", "--family", "qwen2",
         "--max-positions", "1024", "--layers", "1", "--hidden", "32", "--out", "tiny"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "tiny")  # relative to where it ran
    config = AutoConfig.from_pretrained(tmp_path / "tiny")
    assert (config.model_type, config.max_position_embeddings) == ("qwen2", 1024)
    assert Path(DEFAULT_OUT) == REPO_ROOT / "examples" / "arithmetic" / "artifacts" / "tiny-llama"
