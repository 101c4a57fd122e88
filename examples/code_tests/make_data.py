"""Write the code example's datasets as jsonl (train / sft / test): small generated Python
functions, each shown by three of its values, with tests the model's code must pass.

A problem is one function ``f``: ``a*x+b`` (``a`` in -9..9 but 0, ``b`` in -49..49) or
``x*x+b``. The prompt shows its values at 0, 1 and 2 in the tiny model's alphabet
(examples/arithmetic/build_model.py: digits, ``+-*=?:,.``, letters, space, newline, so no
parentheses, underscores or quotes): ``"f 0=-3 1=2 2=7 f x="``. The model answers with the
expression only (``5*x-3``); the signature is the row's ``metadata.code_prefix``
(``"def f(x):\\n    return "``), and ``rollout.rm_type: code_tests`` runs prefix + answer in
the sandbox against the label, a JSON list of five asserts. Two test shown inputs (0, 2) and
three do not (3, 7, -4): an answer that only reproduces the shown values passes at most
two of the five. Three files:

* ``train.jsonl``: the RL prompts, ``{"prompt", "label", "metadata"}``.
* ``sft.jsonl``: the warm start, the same rows plus ``response`` (the expression, written
  ``a*x+b`` with the sign folded in: ``5*x-3``, ``-2*x``, ``x*x+4``) and ``text``. The SFT
  rows are a prefix of the train rows (all of them by default); stopping the warm start
  early is what leaves room for RL.
* ``test.jsonl``: held-out functions, disjoint from train by ``(kind, a, b)``, so the pass
  rate measured on it is generalisation: a held-out prompt never occurs in training.

All 1,881 functions are shuffled once with the seed; the first ``n_test`` are the test set,
the next ``n_train`` the train set. The same arguments always give byte-identical files, and
``write_datasets`` skips the writing when the files already hold what was asked for.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from examples.arithmetic.make_data import write_once

A_RANGE = [a for a in range(-9, 10) if a != 0]
B_RANGE = range(-49, 50)
SHOWN = (0, 1, 2)  # the inputs the prompt shows
TESTED = (0, 2, 3, 7, -4)  # the inputs the label tests: 0 and 2 shown, the rest not
CODE_PREFIX = "def f(x):\n    return "

Function = tuple[str, int, int]  # (kind, a, b): "linear" a*x+b, "square" x*x+b (a unused: 1)


def all_functions() -> list[Function]:
    linear = [("linear", a, b) for a in A_RANGE for b in B_RANGE]
    return linear + [("square", 1, b) for b in B_RANGE]


def evaluate(fn: Function, x: int) -> int:
    kind, a, b = fn
    return (x * x if kind == "square" else a * x) + b


def expression(fn: Function) -> str:
    """The canonical answer: ``5*x-3``, ``-2*x``, ``x*x+4``."""
    kind, a, b = fn
    head = "x*x" if kind == "square" else f"{a}*x"
    return head + (f"+{b}" if b > 0 else f"{b}" if b < 0 else "")


def make_row(fn: Function) -> dict[str, Any]:
    """One problem: prompt ``"f 0=v0 1=v1 2=v2 f x="``, label the tests as a JSON list."""
    shown = " ".join(f"{x}={evaluate(fn, x)}" for x in SHOWN)
    tests = [f"assert f({x}) == {evaluate(fn, x)}" for x in TESTED]
    kind, a, b = fn
    return {"prompt": f"f {shown} f x=", "label": json.dumps(tests),
            "metadata": {"code_prefix": CODE_PREFIX, "kind": kind, "a": a, "b": b}}


def make_sft_row(fn: Function) -> dict[str, Any]:
    """One SFT example: the problem plus the expression it should get."""
    row = make_row(fn)
    row["response"] = expression(fn)
    row["text"] = row["prompt"] + row["response"]
    return row


def split_functions(n_train: int | None, n_test: int, seed: int) -> tuple[list[Function], list[Function]]:
    """Shuffle every function with ``seed``; return (train, test), disjoint. ``n_train``
    None: all the functions not in the test set."""
    functions = all_functions()
    if n_train is None:
        n_train = len(functions) - n_test
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train and n_test must be >= 1, got {n_train} and {n_test}")
    if n_train + n_test > len(functions):
        raise ValueError(f"n_train + n_test = {n_train + n_test} exceeds the "
                         f"{len(functions)} distinct functions")
    random.Random(seed).shuffle(functions)
    return functions[n_test : n_test + n_train], functions[:n_test]


def write_datasets(
    out_dir: str, n_train: int | None = None, n_test: int = 200, seed: int = 0,
    n_sft: int | None = None,
) -> dict[str, str]:
    """Write ``train.jsonl``, ``sft.jsonl`` and ``test.jsonl`` under ``out_dir``.

    Returns ``{"train": path, "sft": path, "test": path}``. Idempotent: when a manifest in
    ``out_dir`` records the same arguments and every file exists, nothing is rewritten.
    ``n_train`` None: every function not held out; ``n_sft`` (None: all of train) is how many
    of the train problems the SFT set holds.
    """
    train, test = split_functions(n_train, n_test, seed)
    n_sft = len(train) if n_sft is None else n_sft
    if not 1 <= n_sft <= len(train):
        raise ValueError(f"n_sft must be in [1, n_train={len(train)}], got {n_sft}")
    params = {"n_train": len(train), "n_test": n_test, "seed": seed, "n_sft": n_sft}
    return write_once(out_dir, params, lambda: {
        "train": [make_row(fn) for fn in train],
        "sft": [make_sft_row(fn) for fn in train[:n_sft]],
        "test": [make_row(fn) for fn in test]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="examples/code_tests/artifacts/data")
    parser.add_argument("--n-train", type=int, default=None,
                        help="RL prompts (default: every function not held out).")
    parser.add_argument("--n-test", type=int, default=200, help="Held-out functions.")
    parser.add_argument("--n-sft", type=int, default=None,
                        help="SFT rows, a prefix of train (default: all).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_datasets(args.out, args.n_train, args.n_test, args.seed, n_sft=args.n_sft)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
