"""A process setup hook for `test_setup_hook.py`: it leaves a mark the actor can report."""

import os

MARK = "GYMRL_SETUP_HOOK_RAN"


def leave_a_mark() -> None:
    os.environ[MARK] = str(os.getpid())
