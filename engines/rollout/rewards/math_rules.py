"""Rule-based math rewards (slime's `math`, `deepscaler`, `dapo`), graded with `math-verify`.

Answer equivalence (1/2 == 0.5 == \\frac{1}{2}, units, sets, ...) is delegated to Hugging
Face's maintained `math-verify` library instead of a hand-rolled LaTeX normaliser; this
module only decides *which part* of a response is the answer, which is what distinguishes
the three rewards:

* `math`       the last \\boxed{...} of the response if there is one, else the whole response.
* `deepscaler` only the text after `</think>` (or `###Response`), and only its \\boxed{} answer:
               a response that never closes its thinking scores 0.
* `dapo`       the last `Answer: ...` line of the response's last 300 characters; scores
               +1 / -1 (not 1 / 0) and returns `{"score", "acc"}` (pick one with reward_key).
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters (slime, verl)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed x`), braces balanced."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    cmd = next(c for c in _BOX_COMMANDS if rest.startswith(c))
    rest = rest[len(cmd) :]
    if rest.startswith(" "):  # "\boxed 5": the argument runs to the next `$` or space
        return rest[1:].split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the model never closed the box


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only works on the main thread (a Ray actor's
    # async loop or a worker thread is not); elsewhere parse/verify run without one. The hub
    # grades these rules in worker processes (`engines.rollout.rewards.deadline`), on their main thread,
    # and bounds each sample there, so these timeouts end most slow parses without a kill.
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.cache
def _math_verify() -> Any:
    """math-verify, imported on first use: with sympy it takes ~0.3 s, which every process
    that imports the reward hub (the driver included) paid before, graded maths or not."""
    import math_verify

    return math_verify


def prepare_worker() -> None:
    """Called in each grading worker as it starts (`engines.rollout.rewards.deadline`), so
    that no deadline pays for math-verify's import."""
    _math_verify()


def _parse(answer: str) -> list[Any]:
    answer = answer.strip()
    if not answer:
        return []
    parse = _math_verify().parse
    parsed = parse(answer, parsing_timeout=_timeout())
    if not parsed and not answer.startswith("$"):
        parsed = parse(f"${answer}$", parsing_timeout=_timeout())
    return list(parsed)


def _normalise_text(text: str) -> str:
    return " ".join(text.strip().strip("$").split()).lower()


def answers_match(predicted: str, gold: str) -> bool:
    """Mathematical equivalence via math-verify; plain text equality when either side does
    not parse as maths (e.g. a multiple-choice letter or a word answer)."""
    pred, ref = _parse(predicted), _parse(gold)
    if pred and ref and _math_verify().verify(ref, pred, timeout_seconds=_timeout()):
        return True
    return _normalise_text(predicted) == _normalise_text(gold)


def _gold(label: str | None) -> str | None:
    """The reference answer; a label that is itself a boxed solution gives its box."""
    if label is None or not str(label).strip():
        return None
    label = str(label)
    return last_boxed(label) or label


def math_score(response: str, label: str | None) -> float:
    gold = _gold(label)
    if gold is None:
        return 0.0
    answer = last_boxed(response)
    return 1.0 if answers_match(response if answer is None else answer, gold) else 0.0


def deepscaler_score(response: str, label: str | None) -> float:
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return 0.0
    answer, gold = last_boxed(solution), _gold(label)
    if answer is None or gold is None:
        return 0.0
    return 1.0 if answers_match(answer, gold) else 0.0


def dapo_score(response: str, label: str | None) -> dict[str, float]:
    found = _DAPO_ANSWER.findall(response[-_DAPO_TAIL_CHARS:])
    gold = _gold(label)
    correct = bool(found) and gold is not None and answers_match(found[-1], gold)
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}
