"""The validator's cross-field rules, grouped as the schema is: one module per config group of
`gymrl.config.schema` (`policy`, `generation`, `trainer`, `loss`, `cluster`, `eval`,
`token_capture`), plus `env` for the rules that read the built Gym shards. A rule sits in the module
of the group whose key it reports (so the rules on `generation.*` are found as the schema's
`generation.py` holds its fields), except that every rule needing the shards is in `env`.

A rule is a small function of the typed config (and the shards, for `env`'s) returning the
:class:`~nemo_gym_ext.config_errors.ConfigIssue` list it finds, empty when it finds none;
`gymrl.preflight.validate` runs them all, in one table that fixes the order issues are reported
in. The rules import what `preflight` may (the schema, the cluster's placement, generation's
parsers and templates, the trainers' capabilities), never torch.
"""
