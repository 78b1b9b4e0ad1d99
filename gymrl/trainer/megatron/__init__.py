"""GRPO training with Megatron-core on GPU clusters, one process per GPU, started as Ray actors.

The package, by concern: `arguments` (config -> Megatron arguments), `batches` (micro-batch
planning, the context-parallel layout), `distributed` (the torch.distributed environment),
`logprobs` (vocabulary-parallel log-probabilities), `checkpointing` (distributed checkpoints and
the Hugging Face export), `router_replay` (the engine's routes in the routers), `worker` (one
rank, `MegatronPolicyTrainer`) and `group` (the ranks as Ray actors, `MegatronTrainerGroup`,
which `gymrl.roles.trainer` drives).

Megatron-core and Megatron-Bridge need CUDA, so they are imported inside the methods that use
them; everything from config to Megatron arguments, micro-batch planning, the context-parallel
layout and metric reduction is a pure function, covered by CPU tests.

How a rank is built:

1. `torch.distributed` from the environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`,
   `LOCAL_RANK`; the group sets them), then
   `parallel_state.initialize_model_parallel` with TP/PP/CP/EP/ETP from the config.
2. The model from the Hugging Face checkpoint through Megatron-Bridge
   (`AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=True)`, parallelism,
   precision and recomputation set on the provider, `provide_distributed_model` wrapping it in
   Megatron's `DistributedDataParallel`).
3. `get_megatron_optimizer` with the distributed optimizer (Adam with decoupled weight decay, i.e.
   AdamW; biases and norms get no weight decay, Megatron's convention) and a constant-rate
   `OptimizerParamScheduler`, which is what writes the learning rate and per-group weight decay.

One `train_step` is one optimizer step over every trajectory of the batch:

* **Planning.** Trajectories are dealt to data-parallel ranks in snake order of length (equal
  counts, balanced tokens), split into micro-batches of `micro_batch_size`, every rank running
  the same number of micro-batches (expert-parallel all-to-alls span data-parallel ranks, so a
  rank with fewer would hang the others; a filler micro-batch trains on nothing). Sequences are
  padded to a multiple of `2 x CP` (Megatron's load-balanced context-parallel split needs two
  chunks per rank) times `TP` under sequence parallelism; with pipeline parallelism every
  micro-batch has one shape, since stages exchange fixed-size activations.
* **Log-probabilities.** The output layer's logits are split over the vocabulary across TP
  ranks; `tensor_parallel.vocab_parallel_cross_entropy` (its negative) gives each position's
  log-probability of the next token without gathering the vocabulary. Logits are divided by the
  sampler's temperature first: generation log-probabilities are those of the temperature-scaled
  distribution, and the importance ratio must compare like with like. Under context parallelism
  each rank holds two chunks of every sequence; the per-token log-probabilities (not the logits)
  are all-gathered with an autograd-aware all-gather and put back in order, so the GRPO loss,
  including per-sequence normalisation, sees whole sequences.
* **Loss.** `gymrl.trainer.grpo_step` (shared with the torch trainer) with the normaliser of
  the whole step (all tokens or all sequences of every rank), so summed gradients equal the
  full-batch gradient. Megatron divides a micro-batch loss by the number of micro-batches and
  averages gradients over data-parallel ranks (summing over context-parallel ones); the returned
  loss is multiplied back by `num_microbatches x DP / CP` (`arguments.megatron_loss_scale`; `/ CP`
  because every CP rank computes the same whole-sequence loss).

Refit: with `generation.refit.transport: nccl` the worker's `send_weights` exports the Hugging
Face weights (`AutoBridge.export_hf_weights`, collective) and rank 0 broadcasts them to the SGLang
servers as they come (`gymrl.generation.sglang.weight_sync.WeightSender`); with `disk`,
`export_hf_checkpoint` writes a Hugging Face checkpoint with `AutoBridge.save_hf_pretrained`
(collective; rank 0 writes), which SGLang then loads with `/update_weights_from_disk`
(`gymrl.generation.sglang.engine.SGLangEngine.refit_from_disk`).
Checkpoints use Megatron's distributed checkpointing (`dist_checkpointing.save/load` of the
model's and the distributed optimizer's sharded state dicts) inside the folder layout and with the
resume state (`gymrl.run.checkpoint.TrainerState`: step, weight version, data position, every rank's
RNG states; the scheduler in `extra`) of the torch trainer.

Router replay (`policy.router_replay.enabled`, `router_replay`): every MoE router of the rank
takes each micro-batch's routes, the experts SGLang routed each token to, sliced like its tokens.

LoRA (`trainer.lora`): megatron-bridge's `LoRA` is attached by a pre-wrap hook after the weights
load, so the base is frozen before DDP builds its buffers and the distributed optimizer holds the
adapter alone; the Hugging Face target names map onto Megatron's fused modules
(`gymrl.trainer.capabilities.MEGATRON_LORA_MODULES`, `arguments.lora_kwargs`). `export_adapter`
gives the adapter in PEFT's format (`gymrl.run.adapter.AdapterWeights`), which the role refits into
the engine (`update_adapter`) and checkpoints write beside an adapter-only distributed checkpoint.

Unsupported here, refused at construction with the fix: a KL term (it needs a reference model,
a second full copy of the weights per rank).
"""
