"""The algorithm, as pure functions and frozen data: trajectories, advantages, the GRPO loss, and
how each agent's episodes enter a step (`episode_rules`).

May import: config.
"""
