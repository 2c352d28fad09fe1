"""Our errors with their own constructor arguments survive pickling.

Ray Train sends a worker's exception to its controller pickled; an error whose ``__init__`` takes other
arguments than its message cannot be rebuilt by the default pickling (``TypeError: __init__() missing ...``),
and the worker's real error was lost behind that (seen in CI on the Ray kill test).
"""

from __future__ import annotations

import pickle

from verl_trainer.recipe_config.loading import ConfigProblemsError
from verl_trainer.training.failure import RankFailedError


def test_rank_failed_error_round_trips():
    error = RankFailedError(3, "Traceback (most recent call last):\n  ...\nValueError: bad batch\n")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is RankFailedError
    assert (back.rank, back.traceback, str(back)) == (error.rank, error.traceback, str(error))
    assert "rank 3 failed" in str(back) and "ValueError: bad batch" in str(back)


def test_config_problems_error_round_trips():
    error = ConfigProblemsError(["unknown key 'a.b'", "invalid value at 'c'"])
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ConfigProblemsError
    assert back.problems == error.problems and str(back) == str(error)
