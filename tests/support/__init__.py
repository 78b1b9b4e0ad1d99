"""Helpers shared by tests of several folders, and by benchmarks outside the test tree: the
SGLang stand-in and the real SGLang server on this CPU, the tokenizer families, the
documented-metrics reader, hostile JSON.

A test imports them as `tests.support.<module>`, never a helper out of another test module; a
folder's own helpers stay beside its tests. What the CPU runs themselves need (the real SGLang
server's `sgl_kernel` stand-in, Megatron's CPU device shim) is not here but in `cpu_standins/`,
which the CPU experiments name and the tests import as `cpu_standins.<folder>.<module>`."""
