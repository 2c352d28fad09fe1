"""A Python process a test starts loads testing/exit_freeze/sitecustomize.py and freezes at exit."""

import os
import subprocess
import sys

CHILD = """
import atexit, gc, sys
made = [[] for _ in range(1000)]
before = gc.get_freeze_count()
atexit._run_exitfuncs()  # what interpreter shutdown runs
print(sys.modules["sitecustomize"].__file__, before, gc.get_freeze_count() >= before + len(made))
"""


def test_a_started_process_freezes_its_objects_at_exit():
    out = subprocess.run([sys.executable, "-c", CHILD], env=dict(os.environ), capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0].endswith(os.path.join("verl_trainer", "testing", "exit_freeze", "sitecustomize.py")), out
    assert out[1:] == ["0", "True"], out
