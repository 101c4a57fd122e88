"""Text-matching rewards: SQuAD-style token F1 (slime's `f1`), exact match, last number."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Answers that are all-or-nothing: partial token overlap with them is meaningless.
_CLOSED_ANSWERS = {"yes", "no", "noanswer"}


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD/HotpotQA rule)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def f1_score(response: str, label: str | None) -> float:
    """Token-level F1 between normalised response and label; 0 when either is empty."""
    if label is None:
        return 0.0
    pred, gold = normalize_answer(response), normalize_answer(label)
    if (pred in _CLOSED_ANSWERS or gold in _CLOSED_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(response: str, label: str | None) -> float:
    """1.0 when response and label agree up to case and surrounding/inner whitespace."""
    if label is None:
        return 0.0
    return 1.0 if " ".join(response.split()).lower() == " ".join(label.split()).lower() else 0.0


def last_number_score(response: str, label: str | None) -> float:
    """1.0 when the last number in the response equals the label's number."""
    if label is None:
        return 0.0
    found = _NUMBER.findall(response)
    return 1.0 if found and found[-1] == label.strip() else 0.0
