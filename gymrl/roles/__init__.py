"""One module per Ray role: its actor, the driver's handle on it, and the `start_*` function
that creates it where the placement says and registers its closer.

Every `start_*` takes `on_cleanup(what, close)` (`gymrl.cluster.session.OnCleanup`): the
`ClusterSession`'s stack of closers, which every recipe and benchmark starts its roles on, pushed
the moment the role exists, so a start-up that fails half-way leaves nothing running. What each
role reserves (GPUs, CPUs, its bundle) comes from `gymrl.cluster.placement`; the decorators'
`num_cpus=0` is what an actor without options gets.

May import: config, run, cluster, model, algo, generation, trainer, experience.
"""
