"""The test tree, as packages (every folder has an `__init__.py`): a test module is imported by
its dotted path from the repository root (`tests.gymrl.generation.torch.test_engine`), so two
modules may share a file name in different folders (`torch/test_engine.py`,
`sglang/test_engine.py`), as the test files mirror the modules they test. Helpers are imported
the same way: a folder's own beside its tests, the shared ones from `tests.support`."""
