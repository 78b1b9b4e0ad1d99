"""The recipes: the GRPO training run (`training`), evaluation, serving the policy alone, the
entry the `recipes/*.py` scripts call, and one point of a sweep. The top floor: each recipe starts
the roles it needs and closes them in reverse.

May import: config, run, cluster, tracking, model, algo, generation, trainer, experience,
preflight, roles.
"""
