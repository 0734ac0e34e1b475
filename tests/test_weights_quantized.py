"""Checkpoints with a `quantization_config`: FP8 (block-wise, as Qwen3-8B-FP8 and DeepSeek-V3 ship) and MXFP4
(gpt-oss) are dequantized on load on every device, served exactly and updated with full-precision weights;
every other method is refused at construction, before any weight loads, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rollout import SamplingParams
from rollout.config import EngineConfig
from tests.conftest import hf_greedy, make_engine, random_prompts, run
from tests.model_zoo import ZOO, build_zoo_model
from tests.test_model_coverage import assert_exact
from workers.engine import model_loading

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
BLOCK = 16  # FP8 scale blocks of 16 x 16 (checkpoints use 128 x 128; the tiny models are 32 wide)


def _requantize(path: Path, quantization_config: dict, convert) -> None:
    """Replace the checkpoint's tensors by `convert(name, tensor)` (a dict of new tensors) and set its
    `quantization_config`."""
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for name, t in tensors.items() for k, v in convert(name, t).items()},
              path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def _fp8(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A decoder layer's projection as float8_e4m3fn with one float32 `weight_scale_inv` per block."""
    if not (name.endswith("proj.weight") and ".layers." in name):
        return {name: tensor}
    rows, cols = tensor.shape
    blocks = tensor.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return {name: quantized, name.removesuffix("weight") + "weight_scale_inv": scale}


def _mxfp4(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's expert weights as MXFP4: random packed FP4 pairs (uint8 blocks) and E8M0 scales."""
    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return {name: tensor}
    experts, inputs, outputs = tensor.shape
    gen = torch.Generator().manual_seed(len(name))
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 127, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
    return {name + "_blocks": blocks, name + "_scales": scales}


QUANTIZED = {
    "fp8": ("qwen3", {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": [BLOCK, BLOCK]}, _fp8),
    "mxfp4": ("gpt_oss", {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}, _mxfp4),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(quantized checkpoint, its unquantized original) per method, built once."""
    built = {}

    def build(method: str) -> tuple[str, str]:
        if method not in built:
            name, quantization_config, convert = QUANTIZED[method]
            original = Path(build_zoo_model(name, tmp_path_factory.mktemp(f"{method}_original")))
            path = tmp_path_factory.mktemp(method)
            shutil.copytree(original, path, dirs_exist_ok=True)
            _requantize(path, quantization_config, convert)
            built[method] = str(path), str(original)
        return built[method]
    return build


def _no_accelerator_raises() -> bool:
    """torch 2.6's `torch.accelerator.current_accelerator()` raises where there is none, and transformers 5.17's
    MXFP4 loader calls it even to dequantize, so neither the engine nor the reference can load MXFP4 there."""
    try:
        torch.accelerator.current_accelerator()
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.skipif(
    m == "mxfp4" and _no_accelerator_raises(), reason="MXFP4 loads only with an accelerator on this torch"))
    for m in sorted(QUANTIZED)])
def test_dequantized_checkpoint_is_exact_and_takes_full_precision_weights(quantized, method):
    """Served as transformers dequantizes it (greedy and logprobs exact); a trainer's full-precision weights
    under the model's names then replace it exactly; the quantized checkpoint itself is refused as an update."""
    path, original = quantized(method)
    engine = assert_exact(path)
    model = engine.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "plain full-precision modules"
    prompt = random_prompts(1, 128, (20, 20), seed=3)[0]
    engine.update_weights(transformers.AutoModelForCausalLM.from_pretrained(original).state_dict(), version=1)
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(original, prompt)
    with pytest.raises(ValueError, match="weights refused"):
        engine.update_weights(path, version=2)


def test_dequantized_on_a_gpu_that_runs_fp8_too(quantized, monkeypatch):
    """Where transformers would keep FP8 modules (a GPU of compute capability 8.9 or more), the engine still
    loads plain modules, which full-precision weights update exactly: what is served does not depend on the card."""
    path, _ = quantized("fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    model = model_loading.load_model(EngineConfig(model=path, device="cpu", dtype="float32"))
    assert {type(m) for m in model.modules() if "Linear" in type(m).__name__} == {torch.nn.Linear}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("quantization_config, method", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32}, "awq"),
    ({"load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ({"quant_method": "torchao"}, "torchao"),
    ({"quant_method": "mxfp8"}, "mxfp8"),
    ({"quant_method": "a_method_transformers_skips"}, "a_method_transformers_skips"),
])
def test_other_quantized_checkpoint_is_refused_before_weights_load(tmp_path, quantization_config, method):
    """Quantized modules are not verified exact and cannot take a trainer's full-precision weights; an unknown
    method transformers skips, loading packed tensors as weights. The directory holds no weights at all: the
    refusal comes from the config alone."""
    config_class, kwargs = ZOO["qwen3"]
    config_class(**kwargs, quantization_config=quantization_config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"quantization_config\.quant_method='{method}'.*unquantized"):
        make_engine(str(tmp_path))
