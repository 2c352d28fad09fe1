"""``python -m verl_trainer <command> ...`` is ``verl-trainer <command> ...`` (:mod:`verl_trainer.cli`)."""

import sys

from verl_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
