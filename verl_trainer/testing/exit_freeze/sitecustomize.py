"""Every Python process a test starts freezes its objects as it exits.

``tests/conftest.py`` puts this directory on ``PYTHONPATH``; Python imports ``sitecustomize`` at start-up.

Interpreter shutdown runs full cyclic collections that walk every live object: ~1.2 s of CPU in a process
that imported torch, transformers and the project (a recipe, a launched script, a spawned rank), spent after
its work is done. ``gc.freeze`` moves those objects out of the collector's reach, so shutdown skips the walk.

Contract: registered first, so it runs after every other ``atexit`` handler (they run last-in, first-out);
what a process computed or wrote is unchanged. Reference counting still frees objects at shutdown; only
unreachable cycles left at exit are not collected, which Python never guaranteed to do.
"""

import atexit
import gc

atexit.register(gc.freeze)
