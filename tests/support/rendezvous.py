"""Where spawned test ranks meet: a file, not a TCP port. A port picked free and bound later by
rank 0's store can be taken in between by any outgoing connection on a busy machine (CI lost a
gloo rendezvous to EADDRINUSE that way); a fresh file in the test's own directory cannot."""

from __future__ import annotations

import uuid
from pathlib import Path


def file_rendezvous(directory: str | Path) -> str:
    """A `torch.distributed` init_method no other process group shares."""
    return f"file://{Path(directory).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"
