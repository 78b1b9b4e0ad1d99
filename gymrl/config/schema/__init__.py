"""Typed schema of the composed Hydra tree. Every default and its meaning lives here, and only here.

One module per top-level key of the tree, named after it, so `generation.refit.*` is in
`generation.py` as its YAML is in conf/generation/: `run`, `policy`, `generation`, `trainer`,
`loss`, `env`, `cluster`, `logger`, `grpo`, `checkpoint`, `stop`, `token_capture` and `eval`;
`recipe.RecipeConfig` is the root that holds them, and `base.Strict` the base they share. Import a
class from its module (`from gymrl.config.schema.generation import RefitConfig`): this package
re-exports nothing, so each class has one name.

A default that depends on the backend lives in that backend's class (`TorchOptimizerConfig` and
`MegatronOptimizerConfig`, `TorchModelServerConfig` and `SGLangModelServerConfig`).
`gymrl.config.compose` turns these defaults into the base of the Hydra composition, so conf/
restates none of them (a test enforces it) and `python recipes/grpo.py --cfg job` shows them all.

Hydra composes YAML; :func:`gymrl.preflight.validate.validate_config` turns the result into a
:class:`RecipeConfig` once, on the recipe's first line, and the rest of the code receives only this
typed object. `extra="forbid"` everywhere: Hydra merges a typo inside an experiment file silently,
so this is the only place it can be caught.

The one deliberately untyped subtree is `env.nemo_gym`: Gym's own global config, forwarded as is.
Its recipe-only keys are typed by `nemo_gym_ext.config.NemoGymPostprocessConfig`.

Checks that span fields (GPU counts, parallelism, truncation compatibility) live in
`gymrl.preflight.rules`, a module per group of this package, run by `gymrl.preflight.validate`,
which reports each issue with its key, value and fix.
"""
