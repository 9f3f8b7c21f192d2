"""Built-in tools, and the environment that serves them to the model.

The model calls a tool by writing ``<name>argument</name>``; its turn ends at the closing tag (a stop string), the
tool runs, and the model reads ``<result>...</result>`` after it. A turn with no call ends the episode: its text is
the answer the scorer scores. Tools:

- ``calculator``: arithmetic on numbers (``+ - * / // % **`` and parentheses), parsed with :mod:`ast`, never
  evaluated as Python;
- ``python``: the argument runs as a Python script in the sandbox (:mod:`services.environment.sandbox`), and its
  output is the result.

Whatever a call does (a malformed expression, code that crashes, loops, or prints a gigabyte), the model gets a
result that says so, and the episode goes on.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

from common.config import EnvironmentSection
from services.environment.base import Environment, Step
from services.environment.sandbox import Sandbox

__all__ = ["TOOLS", "CalculatorError", "ToolEnvironment", "calculate"]

MAX_EXPRESSION = 200  # characters of a calculator expression
MAX_DIGITS = 60  # of any number the calculator computes
MAX_EXPONENT = 200


class CalculatorError(ValueError):
    """An expression the calculator does not compute, with the reason (what the model reads)."""


_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# Thousands separators between digits ("12,345"), and the signs people write for × ÷ and powers.
_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}\b)")
_SIGNS = str.maketrans({"×": "*", "÷": "/", "−": "-", "^": "**"})


def _bounded(value):
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _check_power(base, exponent) -> None:
    """Refuse a power too large to compute before computing it."""
    if abs(exponent) > MAX_EXPONENT or (
        abs(base) > 1 and exponent > 1 and math.log10(abs(base)) * exponent >= MAX_DIGITS
    ):
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalculatorError(str(exc)) from None
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (an integer when it is one); raises
    :class:`CalculatorError` with the reason for anything else."""
    text = _SEPARATOR.sub("", expression.strip().translate(_SIGNS)).rstrip("=").strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {text!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class _Calculator:
    name = "calculator"

    def __init__(self, config: EnvironmentSection):
        pass

    def __call__(self, argument: str) -> tuple[str, str]:
        try:
            return calculate(argument), "ok"
        except CalculatorError as exc:
            return f"error: {exc}", "error"


class _Python:
    name = "python"

    def __init__(self, config: EnvironmentSection):
        self.sandbox = Sandbox(config.sandbox)

    def __call__(self, argument: str) -> tuple[str, str]:
        result = self.sandbox.run_python(argument)
        return result.observation(), result.status


TOOLS: dict[str, type] = {tool.name: tool for tool in (_Calculator, _Python)}


class ToolEnvironment(Environment):
    """The model calls ``environment.tools`` by tag; a turn without a call is its answer and ends the episode. The
    environment gives no reward of its own: the scorer scores the answer (``reward``)."""

    def __init__(self, config: EnvironmentSection):
        super().__init__(config)
        unknown = sorted(set(config.tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"environment.tools: unknown {unknown}; built-in tools are {sorted(TOOLS)}")
        self.tools = {name: TOOLS[name](config) for name in config.tools}
        self.stop = self.stops(config)

    @classmethod
    def stops(cls, config: EnvironmentSection) -> tuple[str, ...]:
        return tuple(f"</{name}>" for name in config.tools)

    def reset(self, prompt: str, label: str) -> None:
        self.calls = 0
        # What the model has read and written since its last result: a prompt may end inside a call (its opening
        # tag written for the model), which the model's first turn closes.
        self.since_result = prompt

    def step(self, turn: str) -> Step:
        self.since_result += turn
        # The call the turn stopped at: its last closing tag (the sampler's last token may run a little past it).
        closing = {name: turn.rfind(f"</{name}>") for name in self.tools}
        name = max(closing, key=closing.get)
        if closing[name] < 0:
            return Step(done=True, info={"calls": self.calls})
        self.calls += 1
        body = self.since_result[: self.since_result.rfind(f"</{name}>")]
        start = body.rfind(f"<{name}>")
        if start < 0:
            output, status = f"error: </{name}> without <{name}> before it", "malformed"
        else:
            output, status = self.tools[name](body[start + len(name) + 2 :])
        self.since_result = ""
        return Step(observation=f"\n<result>\n{output}\n</result>\n", info={"tool": name, "status": status})
