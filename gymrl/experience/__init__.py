"""The experience a step trains on: rows and their order, the rollout producer and its credits,
the replay buffer, the frozen rollout group, held-out passes (`held_out`: validation and
evaluation), pass@k and the token ledger.

May import: config, algo, run.
"""
