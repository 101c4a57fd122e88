"""Ray's auth mode for every rollflow process, fixed before Ray is imported.

Ray reads `RAY_AUTH_MODE` (and the token) once, when `ray` is imported, so setting it just
before `ray.init` is too late. Importing `engines` (which `flows` and `tasks` do first)
therefore defaults this process to token auth with rollflow's own token
(`$ROLLFLOW_HOME/ray_token`, made once, mode 0600) unless the user chose: an explicit
`RAY_AUTH_MODE`, `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` is left alone. A token client
also talks to a cluster without auth, so the default costs nothing there.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

HOME = Path(os.environ.get("ROLLFLOW_HOME", Path.home() / ".rollflow"))
TOKEN_FILE = HOME / "ray_token"


def auth_token_file() -> Path:
    """The token of rollflow's local heads: made once, readable by its owner only."""
    if not TOKEN_FILE.exists():
        HOME.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile
            return TOKEN_FILE
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return TOKEN_FILE


def prepare_ray_auth() -> str:
    """Default this process to token auth with rollflow's token; returns the mode in force."""
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(auth_token_file())
    return os.environ["RAY_AUTH_MODE"]


def process_auth_mode() -> str:
    return os.environ.get("RAY_AUTH_MODE", "disabled")
