"""gymrl: async GRPO for LLM agents on multi-turn, tool-using environments (the training side).

One folder a room, each on a floor above the rooms it imports; every package's docstring ends
with what that room may import, and tests/gymrl/test_gymrl_layers.py reads those lines and checks
every import of the tree against them (docs/architecture.md draws the same table). The root holds
the `python -m gymrl.<tool>` commands (`report`, `plot`, `dashboard`), which import `tracking`.
`gymrl` may import `nemo_gym_ext` (the Gym side); `nemo_gym_ext` never imports `gymrl`.
"""
