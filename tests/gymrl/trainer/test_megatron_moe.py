"""The tiny Qwen3-MoE (`policy=tiny_qwen3_moe`) trained by the real Megatron trainer with expert
parallelism (`trainer.expert_model_parallel_size`), on the real megatron-core 0.19.2 and
Megatron-Bridge 0.6.2 (`make megatron-venv`): on CUDA where there is one, else on the CPU over
gloo through the CPU device shim `cpu_standins/megatron_trainer/megatron_on_cpu.py`.

Each run is processes of its own (`megatron_moe.py`): EP 1 on one rank, EP 2 on two, where each
rank holds 4 of the 8 experts of every layer, the all-to-all dispatcher sends each token to the
rank of its experts and back, and the dense weights are data-parallel over the two ranks (the
batch split between them). Then a refit from the EP 2 trainer into the real SGLang server, which
needs the SGLang venv too (`SGLANG_VENV`, default `.venv-sglang`; skipped without it).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gymrl.trainer.megatron.arguments import provider_overrides
from nemo_gym_ext.ports import free_port
from tests.gymrl.trainer.megatron_moe import (
    expert_parallel_refit_run,
    expert_parallel_run,
    moe_config,
)
from tests.gymrl.trainer.megatron_setup import DEVICE, megatron_batch
from tests.support.real_sglang import VENV, start_cpu_server

pytestmark = pytest.mark.megatron

REFIT_DEADLINE_S = 600.0


def _spawn(tmp_path_factory, *, ep: int, checkpoints: bool = False) -> dict:
    if torch.cuda.is_available() and torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs, this machine has {torch.cuda.device_count()}")
    folder = tmp_path_factory.mktemp(f"ep{ep}")
    torch.multiprocessing.spawn(
        expert_parallel_run,
        args=(
            ep,
            ep,
            free_port(),
            str(folder / "run.pt"),
            str(folder / "ckpt") if checkpoints else None,
        ),
        nprocs=ep,
        join=True,
    )
    return torch.load(folder / "run.pt", weights_only=False)


@pytest.fixture(scope="module")
def ep1_run(megatron_runtime, tiny_moe_dir, tmp_path_factory):
    """The reference: EP 1, one rank, every expert on it."""
    return _spawn(tmp_path_factory, ep=1)


@pytest.fixture(scope="module")
def ep2_run(megatron_runtime, tiny_moe_dir, tmp_path_factory):
    """EP 2 on two ranks, with a save and resume."""
    return _spawn(tmp_path_factory, ep=2, checkpoints=True)


def test_the_moe_provider_takes_every_override(megatron_runtime, tiny_moe_dir):
    """Megatron-Bridge reads the tiny MoE's folder as an MoE (its Qwen3-MoE bridge), and every
    attribute the trainer sets on it is one of its fields (a misspelt one would be set silently
    and change nothing)."""
    from megatron.bridge import AutoBridge

    config = moe_config(ep=2, ranks=2)
    provider = AutoBridge.from_hf_pretrained(str(tiny_moe_dir)).to_megatron_provider(
        load_weights=False
    )
    assert (provider.num_moe_experts, provider.moe_router_topk, provider.moe_ffn_hidden_size) == (
        8,
        2,
        32,
    )
    fields = {field.name for field in dataclasses.fields(provider)}
    overrides = provider_overrides(config)
    assert set(overrides) <= fields, set(overrides) - fields
    assert overrides["moe_router_load_balancing_type"] == "none"


def test_megatron_moe_logprobs_match_transformers(ep1_run, tiny_moe_dir):
    """Megatron's log-probabilities of the fixed batch are transformers' on the same files, in
    fp32 (routing included: a token sent to other experts would move them by far more)."""
    from gymrl.algo.loss import sequence_logprobs
    from gymrl.model.loading import load_pretrained

    model = load_pretrained(tiny_moe_dir, torch.float32).eval()
    trajectories, _ = megatron_batch(model.config.vocab_size)
    for index, trajectory in enumerate(trajectories):
        ids = torch.tensor([trajectory.token_ids])
        with torch.no_grad():
            expected = sequence_logprobs(model(ids).logits, ids, temperature=0.8)[0]
        mask = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(ep1_run["logprobs"][index])[mask], expected[mask], rtol=0, atol=1e-5
        )


def test_expert_parallel_2_equals_expert_parallel_1(ep1_run, ep2_run):
    """EP 2 against EP 1 on the same batch, in fp32, where only the order of sums differs: each
    rank holds half the experts; log-probabilities within 1e-5 (seen: 1e-6), the step's loss and
    gradient norm within 1e-5 relative (seen: 5e-8), every weight after the step within 1e-4
    relative or 1e-5 absolute, 1% of a full Adam step at this learning rate (seen: 4e-8 on the
    experts, 1e-6 on one embedding element whose gradient lies below Adam's eps, so that the
    order of the data-parallel sum moves its small update). Gradients are not compared: at EP 2
    the dense weights are data-parallel over the two ranks, and the distributed optimizer leaves
    each rank the reduced gradient of its own shard only."""
    assert ep2_run["expert_parameters"] == [ep1_run["expert_parameters"][0] // 2] * 2
    assert sorted(ep2_run["logprobs"]) == sorted(ep1_run["logprobs"])
    for index, expected in ep1_run["logprobs"].items():
        torch.testing.assert_close(
            torch.tensor(ep2_run["logprobs"][index]), torch.tensor(expected), rtol=0, atol=1e-5
        )
    for key in ("loss", "grad_norm", "num_tokens", "num_sequences"):
        assert ep2_run["metrics"][key] == pytest.approx(ep1_run["metrics"][key], rel=1e-5), key
    assert sorted(ep2_run["weights"]) == sorted(ep1_run["weights"])
    for name, expected in ep1_run["weights"].items():
        torch.testing.assert_close(ep2_run["weights"][name], expected, rtol=1e-4, atol=1e-5)
    before, after = ep1_run["exported"], ep1_run["weights"]
    assert [name for name in after if torch.equal(after[name], before[name])] == []  # all moved


def test_the_export_holds_every_expert_under_its_hugging_face_name(ep2_run, tiny_moe_dir):
    """`export_weights` at EP 2, before any step: exactly the checkpoint's names (each of the
    96 expert tensors, gathered from the rank that holds it), each value bit-equal."""
    checkpoint = load_file(str(tiny_moe_dir / "model.safetensors"))
    exported = ep2_run["exported"]
    assert sorted(exported) == sorted(checkpoint)
    experts = [name for name in exported if ".mlp.experts." in name]
    assert len(experts) == 4 * 8 * 3
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name].cpu(), tensor), name


def test_the_hugging_face_checkpoint_at_ep_2_reloads_in_transformers(ep2_run):
    """`export_hf_checkpoint` at EP 2 (the disk refit's export): transformers reloads it as the
    tiny Qwen3-MoE, every tensor bit-equal to the trained weights."""
    from gymrl.model.loading import load_pretrained

    reloaded = load_pretrained(ep2_run["hf_checkpoint"], torch.float32)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM" and reloaded.config.num_experts == 8
    written = load_file(str(Path(ep2_run["hf_checkpoint"]) / "model.safetensors"))
    assert sorted(written) == sorted(ep2_run["weights"])
    for name, tensor in ep2_run["weights"].items():
        assert torch.equal(written[name], tensor), name


def test_expert_parallel_2_resumes_from_its_distributed_checkpoint(ep2_run):
    """Save at EP 2, step (the uninterrupted run), step again, load, step: the resumed step gives
    the uninterrupted one's metrics and weights, bit for bit on the CPU; each rank wrote its own
    shards (its experts among them)."""
    assert ep2_run["resume_info"]["step"] == 1
    assert ep2_run["resume_info"]["data_state"] == {"position": 7}
    saved_at, restored_to = ep2_run["versions"]
    assert saved_at == restored_to
    # torch.distributed.checkpoint names a rank's shards __<rank>_<n>.distcp
    writers = {Path(name).name.split("_")[2] for name in ep2_run["checkpoint_files"]}
    assert writers == {"0", "1"}, ep2_run["checkpoint_files"]
    saved, restored = ep2_run["saved"], ep2_run["restored"]
    assert [name for name in saved if not torch.equal(saved[name], restored[name])] == []
    expected, resumed = ep2_run["expected"], ep2_run["resumed_weights"]
    if DEVICE == "cpu":
        assert ep2_run["resumed"] == ep2_run["uninterrupted"]
        assert [name for name in expected if not torch.equal(expected[name], resumed[name])] == []
    else:  # CUDA's atomic adds may reorder sums
        assert ep2_run["resumed"] == pytest.approx(ep2_run["uninterrupted"], rel=1e-5)
        for name, tensor in expected.items():
            torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- refit into SGLang
@pytest.fixture(scope="module")
def moe_server(tiny_moe_dir, tmp_path_factory):
    """The real SGLang server of the tiny MoE, launched for router replay, whose weight-check
    compare runs on the CPU (the stand-in's, `sglang_moe_on_cpu.py`)."""
    if not (VENV / "bin" / "python").is_file():
        pytest.skip(
            f"no SGLang venv at {VENV}: run `make sglang-venv` (or set SGLANG_VENV) for the "
            "refit from Megatron into the real SGLang server"
        )
    server = start_cpu_server(
        tiny_moe_dir,
        tmp_path_factory.mktemp("sglang_moe") / "server.log",
        context_length=256,
        routed_experts=True,
        weight_compare=True,
    )
    try:
        yield server
    finally:
        server.stop()


def test_a_refit_from_expert_parallel_2_into_the_real_sglang_server(
    megatron_runtime, tiny_moe_dir, moe_server, tokenizer, tmp_path
):
    """The EP 2 trainer's unchanged weights refit the server with the weight check on: the
    server randomised every tensor before the refit and compared each with its start-up value
    after it, so every tensor it holds, each expert's included, was written by one the trainer
    sent under its Hugging Face name; its greedy ids and log-probs are the ones before. After one
    train step and a refit both change."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    prompt = list(tokenizer("Name three colours.", add_special_tokens=False)["input_ids"])
    out = tmp_path / "refit.pt"
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(
            target=expert_parallel_refit_run,
            args=(rank, 2, moe_server.base_url, prompt, port, str(out)),
        )
        for rank in range(2)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(REFIT_DEADLINE_S)
    for rank in ranks:
        if rank.is_alive():
            rank.kill()
            rank.join(30)
    codes = [rank.exitcode for rank in ranks]
    assert codes == [0, 0], f"the EP 2 refit run failed (exit codes {codes})"
    seen = torch.load(out, weights_only=False)

    loaded, unchanged, trained = seen["loaded"], seen["unchanged"], seen["trained"]
    assert unchanged["weight_version"] == 0 and trained["weight_version"] == 1
    assert unchanged["token_ids"] == loaded["token_ids"]
    assert unchanged["logprobs"] == pytest.approx(loaded["logprobs"], abs=1e-6)
    assert trained["token_ids"] != loaded["token_ids"]
    checkpoint = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert seen["sent_names"] == sorted(checkpoint)  # every tensor, the output layer's too
    size = sum(tensor.numel() for tensor in checkpoint.values())
    assert seen["bytes"] == seen["trained_bytes"] == 4 * size  # float32
    names = sorted(checkpoint)
    print(
        f"\nMoE refit from EP 2 into the real SGLang server, weight check on: {seen['bytes']} "
        f"bytes ({len(names)} tensors), {seen['seconds']:.2f} s unchanged (snapshot, "
        f"randomise, send, compare), {seen['trained_seconds']:.2f} s after the step"
    )
