"""Built-in NeMo-Gym-shaped environments served on loopback.

`registry` (names, rows, `start_builtin_environment`), `agent` (the shared agent loop),
`resources` (the resources-server plumbing), one module per environment (`calculator`,
`guess_number`) and `tools` (the safe arithmetic evaluator).
"""
