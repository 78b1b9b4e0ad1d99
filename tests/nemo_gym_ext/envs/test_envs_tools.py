import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_gym_ext.envs.tools import (
    MAX_EXPRESSION_CHARS,
    ExpressionError,
    evaluate_expression,
    format_number,
)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("17 + 25", 42),
        ("(12 + 7) * 3", 57),
        ("-5 + 2", -3),
        ("+4", 4),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        ("  3*(4+(5-1))  ", 24),
    ],
)
def test_valid_expressions_evaluate(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "names are not allowed (found 'x')"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).real", "attribute access is not allowed (found .real)"),
        ("abs(-1)", "function calls are not allowed"),
        ("2 ** 1000", "exponent 1000 is too large"),
        ("10 ** 16", "result is too large"),
        ("9 ** 64", "result is too large"),
        ("1.5 ** 64 ** 2", "exponent 4096 is too large"),
        ("2 ^ 3", "write powers as a ** b"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("[1, 2]", "List is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("1 +", "cannot parse"),
        ("", "expression is empty"),
        ("1+" * 150 + "1", f"at most {MAX_EXPRESSION_CHARS} allowed"),
    ],
)
def test_unsafe_or_invalid_expressions_are_rejected_with_a_reason(expression, message):
    with pytest.raises(ExpressionError) as caught:
        evaluate_expression(expression)
    assert message in str(caught.value)


@settings(max_examples=60, deadline=None)
@given(
    # 300**6 < 1e15: every result stays inside the evaluator's magnitude bound, which has its
    # own test above (999**6 does not, and failed now and then).
    st.lists(st.integers(-300, 300), min_size=1, max_size=6),
    st.lists(st.sampled_from(["+", "-", "*"]), min_size=5, max_size=5),
)
def test_integer_arithmetic_matches_python(numbers, operators):
    expression = str(numbers[0])
    for operator, number in zip(operators, numbers[1:], strict=False):
        expression += f" {operator} ({number})"
    assert evaluate_expression(expression) == eval(expression)  # trusted, test-built text


def test_numbers_are_formatted_without_spurious_decimals():
    assert format_number(42) == "42"
    assert format_number(6.0) == "6"
    assert format_number(3.5) == "3.5"
    assert format_number(1 / 3) == "0.3333333333"
