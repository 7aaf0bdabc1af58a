"""The shared DFlash serving layout: layer ids the engines capture correctly, a config that describes
our network, the weights under the official names."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.errors import ExportError
from diffdraft.export.layout import capture_point, check_taps, serving_config, serving_weights

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


def engine_captures(target: torch.nn.Module, config: dict, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states a serving engine feeds the drafter for an exported config.

    vLLM: ``get_eagle3_aux_layers_from_config`` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)
    turns ``dflash_config.target_layer_ids`` into aux layers ``id + 1``, and the target appends the
    residual stream before running decoder layer ``idx`` when ``idx`` is an aux layer. SGLang:
    ``Qwen3ForCausalLM.set_dflash_layers_to_capture`` (python/sglang/srt/models/qwen3.py) sets
    ``layers_to_capture = [id + 1 ...]`` and the model captures "before layer i". Both: the input of
    decoder layer ``id + 1``, recorded here with forward pre-hooks.
    """
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
        def record(module, args, kwargs):
            captured[index] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return record

    handles = [
        target.model.layers[capture_point(i)].register_forward_pre_hook(hook(i), with_kwargs=True)
        for i in config["dflash_config"]["target_layer_ids"]
    ]
    try:
        with torch.no_grad():
            target(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return [captured[i] for i in config["dflash_config"]["target_layer_ids"]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exported_ids_make_the_engines_capture_the_states_the_drafter_was_trained_on(family):
    """diffdraft taps id ``i`` as Hugging Face ``hidden_states[i + 1]`` (src/diffdraft/target/model.py); an
    engine reading the exported ids must capture exactly those tensors. Writing the ids shifted by
    one either way (the off-by-one DESIGN.md warns of) makes this fail."""
    target = tiny_target(family, layers=5)
    ids = [0, 2, 3]
    config = serving_config(tiny_drafter(target, layers=2, target_layer_ids=ids))
    input_ids = torch.tensor([[3, 17, 5, 42, 8, 11]])
    with torch.no_grad():
        trained_on = target(input_ids, output_hidden_states=True).hidden_states
    served = engine_captures(target, config, input_ids)
    for layer_id, state in zip(ids, served, strict=True):
        torch.testing.assert_close(state, trained_on[layer_id + 1])
        assert not torch.allclose(state, trained_on[layer_id]), "the capture is not one layer early"
        assert not torch.allclose(state, trained_on[layer_id + 2]), "the capture is not one layer late"


def test_taps_of_the_last_layer_are_refused():
    """Its output after the final norm (``hidden_states[L]``) is the input of no layer."""
    target = tiny_target("qwen3", layers=4)
    model = tiny_drafter(target, target_layer_ids=[0, 3])
    with pytest.raises(ExportError, match=r"target_layer_ids \[3\] cannot be served.*\[0, 2\]"):
        check_taps(model, "vLLM", 4)
    check_taps(tiny_drafter(target, target_layer_ids=[0, 2]), "vLLM", 4)
    check_taps(model, "vLLM", None)  # depth unknown: nothing to check against


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    ],
)
def test_the_config_rebuilds_the_same_network(rope):
    """An engine builds a Qwen3 config from config.json: it must describe our network exactly."""
    target = tiny_target("qwen3", rope_parameters=rope)
    model = tiny_drafter(target, layers=2, target_layer_ids=[0, 1])
    config = serving_config(model)
    rebuilt_config = Qwen3Config(**config)
    assert rebuilt_config.rope_parameters == rope
    assert config["rope_theta"] == rope["rope_theta"]  # transformers 4.x reads this, not rope_parameters
    assert (config["rope_scaling"] is None) == (rope["rope_type"] == "default")
    assert config["layer_types"] == ["full_attention", "full_attention"]  # bidirectional, as ours
    assert config["use_sliding_window"] is False and config["sliding_window"] is None
    rebuilt = DFlashDraftModel(rebuilt_config).to(torch.float64)
    rebuilt.load_state_dict(serving_weights(model), strict=True)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(rebuilt.state_dict()[name], tensor, rtol=0, atol=0)


def test_settings_live_in_dflash_config_only():
    """Top-level copies (which draft_setting also reads) would be read or cross-checked by the engines;
    a stale eagle_aux_hidden_state_layer_ids would even override the taps in vLLM."""
    model = tiny_drafter(tiny_target("qwen3"), target_layer_ids=[0, 1])
    for key, value in {
        "target_layer_ids": [5],
        "mask_token_id": 1,
        "eagle_aux_hidden_state_layer_ids": [9],
    }.items():
        setattr(model.config, key, value)
    config = serving_config(model)
    assert config["dflash_config"] == {"mask_token_id": model.mask_token_id, "target_layer_ids": [0, 1]}
    assert not {"target_layer_ids", "mask_token_id", "eagle_aux_hidden_state_layer_ids"} & set(config)
