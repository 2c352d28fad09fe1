"""Code-execution rewards: fraction of test cases passed, verl's layouts, through default_compute_score."""

from __future__ import annotations

import json

import pytest

from verl_trainer.rewards import default_compute_score
from verl_trainer.rewards.code import code_score, extract_code, load_test_cases
from verl_trainer.rewards.sandbox import SandboxLimits

ADD = "I read two numbers.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone."
STDIN_CASES = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "11\n"]}


def test_stdin_tests_fraction_passed_from_the_ground_truth_json():
    out = default_compute_score("codecontests", ADD, json.dumps(STDIN_CASES))
    assert out == {"score": pytest.approx(2 / 3), "acc": 0.0, "tests": 3.0, "code_errors": 0.0,
                   "code_timeouts": 0.0}


def test_call_based_tests_from_extra_info():
    response = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    cases = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], 7]}
    assert default_compute_score("apps", response, "", {"test_cases": cases})["score"] == 1.0
    assert default_compute_score("apps", response, "", {"test_cases": json.dumps(cases)})["acc"] == 1.0


def test_crashing_looping_and_missing_programs_pass_nothing():
    limits = SandboxLimits(timeout_s=2.0)
    crashed = code_score("```python\nraise SystemExit(3)\n```", STDIN_CASES, limits=limits)
    assert crashed["score"] == 0.0 and crashed["code_errors"] == 3.0 and crashed["code_timeouts"] == 0.0
    looped = code_score("```python\nwhile True: pass\n```", {"inputs": ["1"], "outputs": ["1"]},
                        limits=limits)
    assert looped["score"] == 0.0 and looped["code_timeouts"] == looped["code_errors"] == 1.0
    assert code_score("no code at all", {"fn_name": "f", "inputs": [[1]], "outputs": [1]}, limits=limits)[
        "score"] == 0.0


def test_extract_code_and_bad_layouts():
    assert extract_code("```\nx\n```\n```py\ny\n```\n```\nz\n```") == "y\n"
    assert extract_code("```\nx\n```") == "x\n" and extract_code("print(1)") == "print(1)"
    with pytest.raises(ValueError, match=r"need \{'inputs': \[...\], 'outputs': \[...\]\} lists"):
        load_test_cases({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="not JSON"):
        load_test_cases("{oops")
