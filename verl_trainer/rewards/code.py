r"""Code-execution rewards: the response's program run against test cases in the sandbox, fraction passed.

Test cases in verl's layout (PRIME / APPS / TACO style), from ``extra_info["test_cases"]`` when the row has
it, else from the ground truth; a dict or its JSON string::

    {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}                 # stdin -> stdout
    {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}             # call-based

The program is the last fenced code block of the response (```` ```python ```` preferred), else the whole
response. Each test runs in its own :func:`verl_trainer.rewards.sandbox.run_python` (under nsjail or
bubblewrap: no file of the host but the interpreter's, no network, time, memory, process and disk limits).
stdin tests compare stdout line by line with trailing white space ignored; call-based tests call
``fn_name`` (a module-level function, or a method of ``class Solution``) with the input's items and compare
the JSON of the result with the expected value (or its one-element list, APPS' layout).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from verl_trainer.rewards.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["CODE_DATA_SOURCES", "code_score", "extract_code", "load_test_cases"]

CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco", "code")
"""The data sources :func:`verl_trainer.rewards.default_compute_score` scores with :func:`code_score`."""

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_CALL_HARNESS = """

import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = globals().get({name!r})
if _fn is None and "Solution" in globals():
    _fn = getattr(Solution(), {name!r})
print(_json.dumps(_fn(*_args)))
"""


def extract_code(text: str) -> str:
    """The last ```` ```python ```` block of ``text``, else its last fenced block, else ``text``."""
    blocks = _FENCE.findall(text)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def load_test_cases(ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The test cases of a row (see the module docstring).

    Raises:
        ValueError: Neither holds ``inputs`` and ``outputs`` lists of the same length (the layout shown).
    """
    source = (extra_info or {}).get("test_cases") if isinstance(extra_info, Mapping) else None
    cases = ground_truth if source is None else source
    if isinstance(cases, str):
        try:
            cases = json.loads(cases)
        except json.JSONDecodeError as err:
            raise ValueError(f"code test cases are not JSON ({err}): {cases[:200]!r}") from None
    if (not isinstance(cases, Mapping) or not isinstance(cases.get("inputs"), list)
            or not isinstance(cases.get("outputs"), list) or len(cases["inputs"]) != len(cases["outputs"])
            or not cases["inputs"]):
        raise ValueError(
            "code test cases need {'inputs': [...], 'outputs': [...]} lists of the same, non-zero length "
            "(and 'fn_name' for call-based tests), in extra_info['test_cases'] or the ground truth; got "
            f"{str(cases)[:200]!r}"
        )
    return dict(cases)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in str(text).strip().splitlines()]
    return [line for line in lines if line]


def _run_test(program: str, test_input: Any, expected: Any, fn_name: str | None,
              limits: SandboxLimits) -> tuple[bool, SandboxResult]:
    """Whether the program passes one test, and its run."""
    if fn_name:
        args = test_input if isinstance(test_input, list) else [test_input]
        result = run_python(program + _CALL_HARNESS.format(name=fn_name), json.dumps(args), limits)
        if not result.ok:
            return False, result
        try:
            got = json.loads(result.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return False, result
        return got == expected or [got] == expected, result
    stdin = test_input if isinstance(test_input, str) else "\n".join(map(str, test_input))
    result = run_python(program, stdin, limits)
    want = expected if isinstance(expected, str) else "\n".join(map(str, expected))
    return result.ok and _lines(result.stdout) == _lines(want), result


def code_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
               limits: SandboxLimits | None = None) -> dict[str, float]:
    """The fraction of test cases the response's program passes.

    Args:
        solution_str: The response.
        ground_truth: Test cases (see the module docstring), unless ``extra_info["test_cases"]`` has them.
        extra_info: The row's ``extra_info``.
        limits: Sandbox limits per test (default: :class:`SandboxLimits`: 10 s, 1 GiB, 32 processes).

    Returns:
        ``{"score": passed / tests, "acc": 1 when all passed, "tests": tests, "code_errors": tests whose
        program exited non-zero or was killed, "code_timeouts": tests it ran past the time limit}`` (the
        last two are logged as ``reward/code_errors`` and ``reward/code_timeouts``, means per sample).

    Raises:
        SandboxUnavailableError: No isolation tool can run here (``VERL_SANDBOX=none`` not set).
    """
    cases = load_test_cases(ground_truth, extra_info)
    program = extract_code(solution_str)
    fn_name = cases.get("fn_name") or None
    limits = limits or SandboxLimits()
    passed = errors = timeouts = 0
    for test_input, expected in zip(cases["inputs"], cases["outputs"]):
        ok, result = _run_test(program, test_input, expected, fn_name, limits)
        passed += ok
        errors += result.returncode != 0 or result.timed_out
        timeouts += result.timed_out
    total = len(cases["inputs"])
    return {"score": passed / total, "acc": float(passed == total), "tests": float(total),
            "code_errors": float(errors), "code_timeouts": float(timeouts)}
