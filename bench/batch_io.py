"""Sample batches on disk and S3: rollflow's Arrow files against slime's torch.save of dicts.

The same samples (~1M tokens by default, with per-token loss masks and log-probs) are
written and read back as
  torch    - `torch.save({"rollout_id": k, "samples": [sample dicts]})`, slime's format
  arrow/X  - rollflow's Arrow IPC file (`storage.batch_io`), compressed with X
to a local directory and to a moto S3 server the bench starts on 127.0.0.1. Reads come in
three depths:
  columns  - what a reader gets before touching a row: torch.load's dicts (pickle decodes
             every row), Arrow's table (local files are memory-mapped, no row objects)
  arrays   - flat token / loss-mask / log-prob arrays plus row offsets, what a trainer packs
             into tensors (Arrow: views of the file's buffers; torch: built from the dicts)
  samples  - `Sample` objects for every row (`read_samples`; torch: `Sample(**dict)`)
Each figure is the median of `--repeats` runs; `x torch` divides torch's time by Arrow's.
Usage:
  python -m bench.batch_io --tokens 1000000 --repeats 5
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from storage.batch_io import read_samples, read_table, read_token_arrays, write_samples
from storage.object_store import ObjectStore
from storage.sample import Sample, Status

RUN_DIR = ("steps/000000",)


def make_samples(tokens: int, prompt_len: int, response_len: int, seed: int = 0) -> list[Sample]:
    """Samples of `prompt_len + response_len` tokens (vocabulary 32k) until `tokens`; the
    log-probs are float32 values, as engines report them and Arrow stores them."""
    rng = random.Random(seed)
    n = max(1, tokens // (prompt_len + response_len))
    out = []
    for i in range(n):
        ids = [rng.randrange(32_000) for _ in range(prompt_len + response_len)]
        out.append(Sample(
            index=i, group_index=i // 8, prompt=f"prompt {i // 8}: " + "x" * 200, tokens=ids,
            response="y" * (4 * response_len), response_length=response_len, label=str(i % 97),
            reward=float(i % 2), loss_mask=[1] * response_len,
            rollout_log_probs=np.float32(-5 * np.random.default_rng(i).random(response_len)).tolist(),
            status=Status.COMPLETED, weight_version=3, metadata={"source_line": i // 8},
        ))  # fmt: skip
    return out


def to_dict(s: Sample) -> dict[str, Any]:
    """slime's `Sample.to_dict()`: the fields as plain Python values."""
    d = {f.name: getattr(s, f.name) for f in fields(Sample)}
    d["status"] = str(s.status)
    return d


def torch_write(store: ObjectStore, samples: list[Sample]) -> None:
    buf = io.BytesIO()
    torch.save({"rollout_id": 0, "samples": [to_dict(s) for s in samples]}, buf)
    store.write_bytes(buf.getvalue(), *RUN_DIR, "rollout.pt")


def torch_columns(store: ObjectStore) -> list[dict[str, Any]]:
    if store.protocol == "file":
        data = torch.load(store.path(*RUN_DIR, "rollout.pt"), weights_only=False)
    else:
        data = torch.load(io.BytesIO(store.read_bytes(*RUN_DIR, "rollout.pt")), weights_only=False)
    return list(data["samples"])


def torch_arrays(store: ObjectStore) -> tuple[np.ndarray, ...]:
    rows = torch_columns(store)
    lengths = np.fromiter((len(r["tokens"]) for r in rows), np.int64, len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.fromiter((t for r in rows for t in r["tokens"]), np.int32, int(offsets[-1]))
    mask = np.fromiter((m for r in rows for m in r["loss_mask"]), np.int32)
    logp = np.fromiter((x for r in rows for x in r["rollout_log_probs"]), np.float32)
    return tokens, offsets, mask, logp


def torch_samples(store: ObjectStore) -> list[Sample]:
    return [Sample(**{**d, "status": Status(d["status"])}) for d in torch_columns(store)]


def arrow_arrays(store: ObjectStore) -> tuple[np.ndarray, ...]:
    a = read_token_arrays(store, *RUN_DIR, "rollout.arrow")
    return a.tokens, a.token_offsets, a.loss_mask, a.rollout_log_probs


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@contextmanager
def s3_store() -> Iterator[ObjectStore]:
    """A moto S3 server on a free 127.0.0.1 port with one bucket, for the bench's life."""
    import boto3
    from moto.server import ThreadedMotoServer

    from engines.process import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint, creds = f"http://127.0.0.1:{port}", {"key": "bench", "secret": "bench"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench",
                     ).create_bucket(Bucket="bench")  # fmt: skip
        yield ObjectStore("s3://bench/run", {**creds, "client_kwargs": {
            "endpoint_url": endpoint, "region_name": "us-east-1"}})
    finally:
        server.stop()


def bench_store(
    where: str, store: ObjectStore, samples: list[Sample], repeats: int
) -> list[tuple[Any, ...]]:
    """Rows (where, format, MB, write, columns, arrays, samples) in ms."""
    rows: list[tuple[Any, ...]] = []
    torch_write(store, samples)
    size = store.fs.size(store.path(*RUN_DIR, "rollout.pt")) / 2**20
    rows.append((where, "torch", size, median_ms(lambda: torch_write(store, samples), repeats),
                 median_ms(lambda: torch_columns(store), repeats),
                 median_ms(lambda: torch_arrays(store), repeats),
                 median_ms(lambda: torch_samples(store), repeats)))
    for compression in ("zstd", "lz4", None):
        def write(c: str | None = compression) -> None:
            write_samples(store, samples, *RUN_DIR, "rollout.arrow", compression=c)

        write()
        size = store.fs.size(store.path(*RUN_DIR, "rollout.arrow")) / 2**20
        rows.append((where, f"arrow/{compression or 'none'}", size, median_ms(write, repeats),
                     median_ms(lambda: read_table(store, *RUN_DIR, "rollout.arrow"), repeats),
                     median_ms(lambda: arrow_arrays(store), repeats),
                     median_ms(lambda: read_samples(store, *RUN_DIR, "rollout.arrow"), repeats)))
    return rows


def check_round_trip(store: ObjectStore, samples: list[Sample]) -> None:
    """Both formats give back the samples, and the arrays agree, before anything is timed."""
    write_samples(store, samples, *RUN_DIR, "rollout.arrow")
    torch_write(store, samples)
    assert read_samples(store, *RUN_DIR, "rollout.arrow") == samples == torch_samples(store)
    for a, t in zip(arrow_arrays(store), torch_arrays(store), strict=True):
        assert np.array_equal(a, t), "Arrow and torch arrays differ"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples = make_samples(args.tokens, args.prompt_len, args.response_len)
    n_tokens = sum(len(s.tokens) for s in samples)
    print(f"{len(samples)} samples, {n_tokens:,} tokens ({args.prompt_len} prompt + "
          f"{args.response_len} response each, loss mask and log-probs per response token), "
          f"medians of {args.repeats}, ms")
    rows: list[tuple[Any, ...]] = []
    with tempfile.TemporaryDirectory() as root:
        local = ObjectStore(os.path.join(root, "run"))
        check_round_trip(local, samples)
        rows += bench_store("local", local, samples, args.repeats)
    with s3_store() as s3:
        rows += bench_store("s3", s3, samples, args.repeats)
    print(f"{'where':6s} {'format':11s} {'MB':>6s} {'write':>8s} {'columns':>8s} {'x torch':>8s} "
          f"{'arrays':>8s} {'x torch':>8s} {'samples':>8s} {'x torch':>8s}")
    base = {r[0]: r for r in rows if r[1] == "torch"}
    for where, fmt, size, write, cols, arrays, objs in rows:
        t = base[where]
        print(f"{where:6s} {fmt:11s} {size:6.1f} {write:8.1f} {cols:8.1f} {t[4] / cols:8.1f} "
              f"{arrays:8.1f} {t[5] / arrays:8.1f} {objs:8.1f} {t[6] / objs:8.1f}")


if __name__ == "__main__":
    main()
