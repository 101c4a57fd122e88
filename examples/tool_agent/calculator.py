"""The tool: a calculator the model calls by writing an arithmetic expression and `=`.

The call syntax uses only characters every tokenizer has (the tiny example model's vocabulary
is digits, `+-*=?:,. `, letters and newline), so the same agent runs on the tiny model in CI
and on a real chat model. Evaluation walks the AST: only numbers and + - * / ** and unary
minus, never `eval`.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable

TRIGGER = "="
_CALL = re.compile(r"([0-9.+\-*/() ]*[0-9)])\s*=$")
_OPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
MAX_ABS = 1e12  # keeps `9**9**9`-style inputs from hanging the rollout


class CalculatorError(ValueError):
    pass


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if abs(value) > MAX_ABS:
            raise CalculatorError("result too large")
        return value
    raise CalculatorError(f"unsupported expression: {ast.dump(node)[:40]}")


def evaluate(expression: str) -> str:
    """The value as the model should read it: `36`, `0.5`."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise CalculatorError(str(e)) from None
    return str(int(value)) if value.is_integer() else f"{value:.6g}"


def find_call(text: str) -> str | None:
    """The expression of a call: the text must end with `<expression>=`."""
    match = _CALL.search(text)
    return match.group(1).strip() if match else None


def observe(text: str) -> str | None:
    """The tool's answer to a turn that ended in `=`: the value and a newline, `error` for
    an expression it cannot evaluate, None when the turn made no call."""
    expression = find_call(text)
    if expression is None:
        return None
    try:
        return f"{evaluate(expression)}\n"
    except CalculatorError:
        return "error\n"
