"""An adapter crosses processes (Ray) as its config and safetensors bytes, whatever the process
that pickled it imported (a Megatron rank's megatron-core replaces torch's storage unpickler)."""

import pickle

import torch

from gymrl.run.adapter import AdapterWeights


def test_an_adapter_pickles_as_safetensors_bytes_and_comes_back_equal():
    adapter = AdapterWeights(
        {"r": 2, "lora_alpha": 4, "target_modules": {"q_proj"}},
        {
            "base_model.model.q_proj.lora_A.weight": torch.randn(2, 3),
            "base_model.model.q_proj.lora_B.weight": torch.randn(4, 2).t().t(),
        },
    )
    data = pickle.dumps(adapter)
    assert b"_rebuild_tensor" not in data  # no torch storage pickling: safetensors bytes
    back = pickle.loads(data)
    assert back.config == adapter.config
    assert back.tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(back.tensors[k], t) for k, t in adapter.tensors.items())
