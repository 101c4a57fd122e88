"""The Llama decode step as one compiled call (`csrc/fused_decode.cpp`), built once per
machine with torch's C++ extension builder (g++ and ninja).

At batch 64 on the example model the Python step (`kv_decode.LlamaDecoder`) spent more on
~140 aten dispatches, their temporaries and a thread-pool wake-up per op than on its
matmuls; the compiled step keeps ATen's matmuls and runs everything between them as loops
over the same buffers, each pool thread taking a block of rows through the whole step.
The same extension samples (`sample_rows`, `sample_tokens` here) and runs several steps with
sampling in between (`decode_steps`, the engine's `num_continuous_decode_steps`): at batch
64, sampling in ~12 aten ops and the Python between steps had become a large share of the
time (bench/RESULTS.md, "Embedded engine vs HF generate").

It is built for this machine's CPU (`-march=native`), under a name that carries the CPU's
feature flags (a build cache shared with other machines never hands one code its CPU lacks)
and a digest of the source, in a directory per Python environment (`build_directory`).
`scripts/setup.sh` builds it ahead (`python -m engines.inference.fused_decode`), so that a
first run does not wait for the build.
Anything that stops the build (no compiler or Python headers, `ROLLFLOW_FUSED_DECODE=0`)
leaves the Python step in use, said once in the log; the two give the same tokens and
log-probs within 1e-6.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engines.inference import sampling
from engines.inference.sampling import SamplingRows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fused_decode.cpp"
ENV_SWITCH = "ROLLFLOW_FUSED_DECODE"  # "0": never build or use it
STALE_LOCK_SECONDS = 600
MIN_BLOCK_ROWS = 8  # the fewest rows the compiled step gives a thread (fewer: one thread)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module" once tried (None when unavailable)


def _cpu_tag() -> str:
    """A digest of the CPU's model and feature flags: `-march=native` code is theirs."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:8]


def _with_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; a Ray worker's PATH may lack the venv's bin."""
    import ninja

    dirs = [ninja.BIN_DIR, os.path.dirname(sys.executable)]
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*dirs, path] if path else dirs)


def load() -> Any | None:
    """The compiled module (built on first use), or None where it cannot be had."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def sample_tokens(
    module: Any | None, logits: torch.Tensor, rows: SamplingRows, uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample_tokens` as one compiled call where it applies (the module `load`
    gave, float32 CPU logits, no row truncating with top-p/top-k), instead of ~12 aten ops
    (bench/RESULTS.md, "Embedded engine vs HF generate"). The same draw: the token where the float32 distribution's CDF
    passes the row's uniform; only float rounding at a CDF step can tell the two apart."""
    if (module is None or rows.truncates or logits.dtype != torch.float32
            or logits.device.type != "cpu"):
        return sampling.sample_tokens(logits, rows, uniform)
    tokens, logps = module.sample_rows(logits.contiguous(), rows.divisor, uniform, rows.greedy)
    return tokens, logps


def build_directory(name: str) -> Path:
    """Where it is built: torch's extension cache, one directory per Python environment and
    torch version. A build records the include paths of the torch it was built against, so
    two venvs sharing one directory would rebuild it in turn, at each one's first load."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    env = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:6]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-{env}"
    return Path(base) / tag / name


def _clear_stale_lock(directory: Path) -> None:
    """torch's builder holds a lock file while it builds; a builder killed meanwhile leaves
    it, and every later load would wait on it for ever. A build takes well under a minute."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            log.warning("removing %s, left by a build that did not finish", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _source_copy(directory: Path, code: bytes) -> Path:
    """The source, copied into its build directory: the build records its sources' paths,
    so two checkouts of one source built from their own paths would rebuild in turn at each
    first load, each the other's build being "out of date"."""
    copy = directory / SOURCE.name
    if not copy.exists() or copy.read_bytes() != code:
        partial = directory / f".{SOURCE.name}.{os.getpid()}"
        partial.write_bytes(code)
        os.replace(partial, copy)
    return copy


def _build() -> Any | None:
    started = time.perf_counter()
    try:
        _with_ninja_on_path()
        from torch.utils.cpp_extension import load as load_extension

        code = SOURCE.read_bytes()
        name = f"rollflow_fused_decode_{_cpu_tag()}_{hashlib.sha1(code).hexdigest()[:8]}"
        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory)
        module = load_extension(
            name=name,
            sources=[str(_source_copy(directory, code))],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
        )
    except Exception as exc:  # (no compiler, headers or ninja): the Python step still works
        log.warning("the fused decode step is unavailable (%s: %s); the embedded engine uses "
                    "its Python step", type(exc).__name__, str(exc).splitlines()[0][:300])
        return None
    seconds = time.perf_counter() - started
    if seconds > 10:  # (a build; loading a built one takes milliseconds)
        log.info("built the fused decode step in %.0f s (once per machine and environment)",
                 seconds)
    return module


if __name__ == "__main__":  # scripts/setup.sh: build it now rather than in a first run
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if load() is not None or os.environ.get(ENV_SWITCH) == "0" else 1)
