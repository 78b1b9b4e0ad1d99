"""nemo_gym_ext: the Gym side, what a NeMo-Gym deployment and the recipe agree on. The wire
format (rows, results, OpenAI chat types with the token bundle), the typed agent spec and its
config errors, the postprocessor with its contiguity check and truncation, per-agent metrics,
rollout collection over `/run`, launching or joining a Gym deployment, the built-in environments
(`envs/`), and the child-process, port and HTTP-server plumbing gymrl shares.

Never imports gymrl (tests/nemo_gym_ext/test_gym_side_imports.py imports every module in an
interpreter where gymrl cannot be imported), so it stays usable without the trainer.
"""
