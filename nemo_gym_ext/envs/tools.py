"""A safe arithmetic evaluator for the calculator tool.

The expression comes from a model, so it is untrusted text: it is parsed with `ast` and walked
over a whitelist (numbers, + - * / // % **, unary minus/plus, parentheses). `eval` and `exec` are
never called. Sizes are bounded so that no input can make the server spend noticeable time or
memory: the text length, every intermediate magnitude and the exponent of `**`.

Errors are :class:`ExpressionError` with a message written for the model (it is sent back as the
tool's output), saying what was wrong and what is allowed.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15
MAX_EXPONENT = 64
ALLOWED = "numbers, + - * / // % ** and parentheses"

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class ExpressionError(ValueError):
    """The expression cannot be evaluated; the message is meant for the model."""


def evaluate_expression(text: str) -> Number:
    """Value of the arithmetic expression `text`, or :class:`ExpressionError`."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(
            f"expression is {len(text)} characters long; at most {MAX_EXPRESSION_CHARS} allowed"
        )
    if not text.strip():
        raise ExpressionError(f"expression is empty; write one using {ALLOWED}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as error:
        detail = error.msg if isinstance(error, SyntaxError) else str(error)
        raise ExpressionError(f"cannot parse {text!r} ({detail}); use {ALLOWED}") from error
    return _evaluate(tree.body)


def format_number(value: Number) -> str:
    """Integers plainly; integral floats without `.0`; other floats to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ExpressionError(f"{value!r} is not a number; use {ALLOWED}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ExpressionError(f"exponent {right} is too large; at most {MAX_EXPONENT} allowed")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as error:
            raise ExpressionError("division by zero") from error
        except OverflowError as error:
            raise ExpressionError(f"result is too large (limit {MAX_MAGNITUDE:.0e})") from error
    raise ExpressionError(_unsupported(node))


def _bounded(value: Number | complex) -> Number:
    if isinstance(value, complex):
        raise ExpressionError("result is not a real number (negative number to a fractional power)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"result is too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def _unsupported(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names are not allowed (found {node.id!r}); use only {ALLOWED}"
    if isinstance(node, ast.Attribute):
        return f"attribute access is not allowed (found .{node.attr}); use only {ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; use only {ALLOWED}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "^ is not a power operator here; write powers as a ** b"
    return f"{type(node).__name__} is not allowed; use only {ALLOWED}"
