"""Write the example's two-digit addition datasets as jsonl (train / sft / test).

Why a generator and not a checked-in file: the data is trivial to make, so making it from a
seed keeps the repository small and lets the example (and its tests) pick any size. Why three
files:

* ``train.jsonl``: the RL prompts. Each row is ``{"prompt": "12+34=", "label": "46",
  "metadata": {"a": 12, "b": 34}}``; the label is what the ``exact_match`` reward compares the
  decoded response against.
* ``sft.jsonl``: the warm start. Same rows plus ``response`` (the full answer the model must
  produce after the prompt, the EOS token being added by the trainer) and ``text`` (prompt +
  response). The SFT rows are a prefix of the train rows (all of them by default); what leaves
  room for RL to improve is stopping the warm start early, not hiding problems from it.
* ``test.jsonl``: held-out problems, disjoint from train (and so from sft) by ``(a, b)`` pair,
  so that the accuracy gain measured on it is generalisation, not memorisation.

Operands are two-digit numbers (10..99), so there are 90 * 90 = 8100 distinct problems; all of
them are shuffled once with the seed, the first ``n_test`` become the test set and the next
``n_train`` the train set. The same arguments always give byte-identical files, and
``write_datasets`` skips the writing when the files already hold what was asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable
from typing import Any

LOW, HIGH = 10, 99
NUM_PROBLEMS = (HIGH - LOW + 1) ** 2
MANIFEST = "manifest.json"


def make_row(a: int, b: int) -> dict[str, Any]:
    """One problem: prompt ``"a+b="``, label the decimal sum."""
    return {"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"a": a, "b": b}}


def make_sft_row(a: int, b: int) -> dict[str, Any]:
    """One SFT example: the problem plus the full response it should get."""
    row = make_row(a, b)
    row["response"] = row["label"]
    row["text"] = row["prompt"] + row["response"]
    return row


def split_pairs(
    n_train: int, n_test: int, seed: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Shuffle all ``(a, b)`` pairs with ``seed``; return (train, test), disjoint."""
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train and n_test must be >= 1, got {n_train} and {n_test}")
    if n_train + n_test > NUM_PROBLEMS:
        raise ValueError(
            f"n_train + n_test = {n_train + n_test} exceeds the {NUM_PROBLEMS} distinct "
            f"two-digit problems"
        )
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[n_test : n_test + n_train], pairs[:n_test]


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees a half-written file


def write_once(
    out_dir: str, params: dict[str, Any], make_rows: Callable[[], dict[str, list[dict[str, Any]]]]
) -> dict[str, str]:
    """Write `make_rows()`'s sets as `{name}.jsonl` under `out_dir`, unless its manifest
    already records `params` and every file exists; returns `{name: path}`. The manifest is
    written last, so its presence means the files are complete."""
    rows = make_rows()
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in rows}
    manifest_path = os.path.join(out_dir, MANIFEST)
    if all(os.path.exists(p) for p in paths.values()) and os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            if json.load(f) == params:
                return paths
    os.makedirs(out_dir, exist_ok=True)
    for name, path in paths.items():
        _write_jsonl(path, rows[name])
    tmp = f"{manifest_path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(params, f)
    os.replace(tmp, manifest_path)
    return paths


def write_datasets(
    out_dir: str, n_train: int = 4000, n_test: int = 500, seed: int = 0, n_sft: int | None = None
) -> dict[str, str]:
    """Write ``train.jsonl``, ``sft.jsonl`` and ``test.jsonl`` under ``out_dir``.

    Returns ``{"train": path, "sft": path, "test": path}``. Idempotent: when a manifest in
    ``out_dir`` records the same arguments and every file exists, nothing is rewritten.
    ``n_sft`` (at most ``n_train``; None: all of them) is how many of the train problems the SFT
    set holds.
    """
    if n_sft is None:
        n_sft = n_train
    if not 1 <= n_sft <= n_train:
        raise ValueError(f"n_sft must be in [1, n_train={n_train}], got {n_sft}")
    params = {"n_train": n_train, "n_test": n_test, "seed": seed, "n_sft": n_sft}

    def rows() -> dict[str, list[dict[str, Any]]]:
        train, test = split_pairs(n_train, n_test, seed)
        return {"train": [make_row(a, b) for a, b in train],
                "sft": [make_sft_row(a, b) for a, b in train[:n_sft]],
                "test": [make_row(a, b) for a, b in test]}

    return write_once(out_dir, params, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="examples/arithmetic/artifacts/data")
    parser.add_argument("--n-train", type=int, default=4000, help="RL prompts.")
    parser.add_argument("--n-test", type=int, default=500, help="Held-out problems.")
    parser.add_argument(
        "--n-sft", type=int, default=None, help="SFT rows, a prefix of train (default: all)."
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_datasets(args.out, args.n_train, args.n_test, args.seed, n_sft=args.n_sft)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
