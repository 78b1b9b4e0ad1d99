"""The typed schema of the composed Hydra tree (every default and its description, `schema/`),
its composition (`compose`), and the model's context against the episode's (`context_length`).

The leaf: nothing here imports the rest of the package, so any room can read a config.

May import: nothing.
"""
