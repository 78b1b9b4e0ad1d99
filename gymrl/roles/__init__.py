"""One module per Ray role: its actor, the driver's handle on it, and the `start_*` function
that creates it where the placement says and registers its closer.

Every `start_*` takes `on_cleanup(what, close)`: the caller's stack of closers (the GRPO recipe's,
`serve`'s, a benchmark's), pushed the moment the role exists, so a start-up that fails half-way
leaves nothing running. What each role reserves (GPUs, CPUs, its bundle) comes from
`gymrl.cluster.placement`; the decorators' `num_cpus=0` is what an actor without options gets.

May import: config, run, cluster, model, algo, generation, trainer, experience.
"""

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

OnCleanup = Callable[[str, Callable[[], object]], None]


def close_reporting_failure(what: str, close: Callable[[], object]) -> None:
    """Run one closer of a stack: a role that does not close cleanly is reported, not raised,
    so it neither masks the error that ended the run nor keeps the closers before it from
    running."""
    try:
        close()
    except Exception as error:
        log.warning(f"{what} did not close cleanly: {type(error).__name__}: {error}")
