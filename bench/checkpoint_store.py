"""Storing a staged checkpoint: what the commit of a checkpoint step spends after the save.

A train group saves a checkpoint into a local staging directory, then stores it under the
run (`engines/train/checkpoint_staging.py`: `ObjectStore.put_dir`). The bench writes fresh
files (dirty in the page cache, as a save leaves them) and times three ways of storing them
in a local store on the same file system:
  read+write  - each file read into memory and written atomically with an fsync (what
                `put_dir` did until it streamed; a shard of GBs was a GB-sized bytes object)
  copy        - `put_dir(move=False)`: streamed copy (`shutil.copyfile`), fsync, rename
  move        - `put_dir(move=True)`, what checkpoints use: the staged file is renamed into
                place after its fsync, so its bytes reach the disk once
and the manifest a save writes first (`storage.integrity.dir_manifest`: every file's sha256),
one file at a time and several side by side (what it does).
Figures: bench/RESULTS.md, "Checkpoint store".
Usage:
  python -m bench.checkpoint_store --gib 2 --files 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from storage import integrity
from storage.object_store import ObjectStore


def stage(path: str, files: int, file_bytes: int) -> None:
    os.makedirs(path)
    for i in range(files):
        with open(os.path.join(path, f"shard-{i}.distcp"), "wb") as f:
            f.write(os.urandom(file_bytes))


def read_and_write(store: ObjectStore, staged: str, *parts: str) -> None:
    for name in sorted(os.listdir(staged)):
        with open(os.path.join(staged, name), "rb") as f:
            store.write_bytes(f.read(), *parts, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="checkpoint size")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to stage and store (default: TMPDIR)")
    args = ap.parse_args()
    file_bytes = int(args.gib * 1024**3 / args.files)
    ways: dict[str, Callable[[ObjectStore, str], object]] = {
        "read+write": lambda store, staged: read_and_write(store, staged, "ckpt"),
        "copy": lambda store, staged: store.put_dir(staged, "ckpt"),
        "move": lambda store, staged: store.put_dir(staged, "ckpt", move=True),
    }
    print(f"{args.gib:g} GiB in {args.files} files, staged fresh each time")
    root = tempfile.mkdtemp(prefix="rollflow-ckpt-bench-", dir=args.dir)
    try:
        stage(os.path.join(root, "staging"), args.files, file_bytes)
        store = ObjectStore(os.path.join(root, "staging"))
        threads = integrity._HASH_THREADS
        for label, n in (("sha256, 1 thread", 1), (f"sha256, up to {threads}", threads)):
            integrity._HASH_THREADS = n
            start = time.perf_counter()
            integrity.dir_manifest(store)
            seconds = time.perf_counter() - start
            print(f"{label:>18}: {seconds:6.2f} s  {args.gib / seconds:5.2f} GiB/s", flush=True)
        integrity._HASH_THREADS = threads
    finally:
        shutil.rmtree(root)
    for name, way in ways.items():
        root = tempfile.mkdtemp(prefix="rollflow-ckpt-bench-", dir=args.dir)
        try:
            staged = os.path.join(root, "staging")
            stage(staged, args.files, file_bytes)
            store = ObjectStore(os.path.join(root, "store"))
            start = time.perf_counter()
            way(store, staged)
            seconds = time.perf_counter() - start
            print(f"{name:>10}: {seconds:6.2f} s  {args.gib / seconds:5.2f} GiB/s", flush=True)
        finally:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
