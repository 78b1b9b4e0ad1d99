"""Helpers shared by tests of several folders, and by benchmarks and CPU runs outside the test
tree: the SGLang stand-in and the real SGLang server on this CPU, the tokenizer families,
Megatron's CPU device shim, the documented-metrics reader, hostile JSON.

A test imports them as `tests.support.<module>`, never a helper out of another test module; a
folder's own helpers stay beside its tests. Two folders here are no packages: each is put on
another process's PYTHONPATH, where what it holds is imported by its top-level name:
`sgl_kernel_cpu_standin/` (the real SGLang server's `sgl_kernel`) and `megatron_cpu_shim/`
(`megatron_on_cpu`, which a Megatron worker's setup hook names)."""
