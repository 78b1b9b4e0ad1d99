"""Generation: the engines that sample the policy and the OpenAI-compatible policy server Gym's
agents call, in three wings that share only `types` (requests, outputs, the engine protocols and
their errors):

- `server/`: the policy server (`app`), the chat template and tool-call parsers, the divergence
  watch, the run's sampling rules, the API key and the announcement of the endpoint;
- `torch/`: the plain-torch engine for CPUs and small GPUs (continuous batching, the fused Llama
  decode step, the prefix cache);
- `sglang/`: the client of SGLang servers, the servers themselves, routing, and the refit of
  their weights (`refit`, `weight_sync`, `refit_checks/`).

No wing imports another (the layering test checks it); `gymrl.roles.generation_server` puts an
engine behind the server.

May import: config, run, cluster, model.
"""
