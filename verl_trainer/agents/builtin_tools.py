"""The two built-in tools: a calculator and a sandboxed Python executor.

``calculator`` evaluates arithmetic (``+ - * / // % **``, parentheses, unary minus) by walking the
expression's syntax tree (no ``eval``); ``python`` runs code through
:func:`verl_trainer.rewards.sandbox.run_python` (the project's one sandbox, shared with the code-execution
rewards: nsjail or bubblewrap, see :mod:`verl_trainer.rewards.jail`). Both are named in configs as
``verl_trainer.agents.builtin_tools:calculator`` / ``:python``.
"""

from __future__ import annotations

import ast
import operator

from verl_trainer.agents.tools import ToolError
from verl_trainer.rewards.sandbox import SandboxLimits, run_python

__all__ = ["calculator", "python"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_EXPONENT = 64
_MAX_LENGTH = 200


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise ToolError("division by zero") from exc
    raise ToolError(f"unsupported expression element {ast.dump(node)[:40]!r}; use numbers, + - * / // % ** "
                    "and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12+7)*3".
    """
    if len(expression) > _MAX_LENGTH:
        raise ToolError(f"expression of {len(expression)} characters; at most {_MAX_LENGTH}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from exc
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


PYTHON_LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=512, max_output_bytes=4096)
"""The limits of the :func:`python` tool (one run: 5 s, 512 MiB, 4 KiB of output each stream)."""


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: The program; print the values you need.
    """
    result = run_python(code, limits=PYTHON_LIMITS)
    if result.timed_out:
        raise ToolError(f"the program ran past {PYTHON_LIMITS.timeout_s:g} s and was stopped")
    if result.returncode != 0:
        raise ToolError(f"exit status {result.returncode}: {result.stderr.strip()[-1000:]}")
    return result.stdout


python.uses_sandbox = True  # type: ignore[attr-defined]  (resolve_tools checks the sandbox before models load)
