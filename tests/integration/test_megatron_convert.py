"""Importing the megatron backend's package does not import megatron (a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_package_import_does_not_import_megatron() -> None:
    """A fresh interpreter: CPU installs must be able to import the package without megatron."""
    code = ("import sys, engines.train.megatron, engines.train.megatron.hf_convert, "
            "engines.train.megatron.model; print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
