"""The trainers: the GRPO step both share (`grpo_step`), the torch trainer, the Megatron trainer
(`megatron/`), what each backend cannot do (`capabilities`), prefix packing, and the first step's
log-probability gate (`parity_gate`).

May import: config, run, cluster, model, algo, generation.
"""
