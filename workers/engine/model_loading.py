"""Loading a checkpoint with transformers' own classes for its model type (the code the engine is verified
against): its config, checked before any weight loads, then the model on its device."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import transformers
from safetensors import SafetensorError
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.quantizers.auto import AutoQuantizationConfig

from rollout.config import EngineConfig
from workers.engine import memory
from workers.engine.attention import ATTN_IMPLEMENTATION
from workers.engine.model_support import check_config, max_model_len, refuse


def load_config(path: str | Path, trust_remote_code: bool = False) -> transformers.PretrainedConfig:
    """The checkpoint's config as transformers' own class for its model type, so that its model loads with
    transformers' modelling code, the code the engine is verified against. Another package may register its
    classes over a transformers type: flash-linear-attention does for 'mamba' and 'mamba2' once imported, and
    transformers imports it for Gated DeltaNet layers. Remote code (`trust_remote_code`) is left as it is."""
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    own = CONFIG_MAPPING_NAMES.get(config.model_type)
    package = type(config).__module__.partition(".")[0]
    if own is None or package in ("transformers", "transformers_modules"):
        return config
    return getattr(transformers, own).from_pretrained(path)


def load_model(config: EngineConfig) -> transformers.PreTrainedModel:
    """The model of `config.model` loaded straight onto its device, in eval mode, attention routed
    to the paged cache."""
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"EngineConfig.model={config.model!r} is not a model directory (no config.json)")
    with _load_errors(config):
        hf_config = load_config(path, config.trust_remote_code)
    check_config(hf_config)
    _refuse_remote_model_code(hf_config, config.trust_remote_code)
    _logits_only(hf_config)
    max_model_len(config, hf_config.get_text_config(decoder=True))  # a length past the model's, refused here
    options = _dequantized(config, hf_config)
    if config.device.startswith("cuda"):
        options["device_map"] = config.device
    with _load_errors(config):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, dtype=memory.resolve_dtype(config, hf_config), output_loading_info=True,
            attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=config.trust_remote_code, **options)
    _refuse_missing_weights(config, sorted(info["missing_keys"]))
    return model.eval()


def _refuse_missing_weights(config: EngineConfig, missing: list[str]) -> None:
    """A checkpoint without some of the model's weights (a base model saved without its LM head, a reward
    model, a lost shard) is refused: transformers would fill them with random values, a model of its own."""
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"EngineConfig.model={config.model!r} lacks {len(missing)} of the model's weights "
                         f"({shown}), which transformers would initialise at random; save the whole causal LM "
                         "(e.g. AutoModelForCausalLM's save_pretrained)")


# Quantized checkpoints that transformers dequantizes on load into plain full-precision modules, on every
# device (verified in tests/test_weights_quantized.py): served and updated as the unquantized model would be.
DEQUANTIZED_METHODS = ("fp8", "mxfp4")


def _dequantized(config: EngineConfig, hf_config: transformers.PretrainedConfig) -> dict[str, Any]:
    """The `from_pretrained` option that dequantizes a checkpoint of a method in DEQUANTIZED_METHODS on load,
    whatever the device (transformers would keep FP8 or MXFP4 modules on a GPU that runs them); none for an
    unquantized one. Any other `quantization_config` is refused before weights load: quantized modules
    (GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) are not verified exact, and a trainer's full-precision
    weights cannot be copied into them; an unknown method transformers would skip, loading packed tensors as
    if they were weights."""
    quant = getattr(hf_config, "quantization_config", None) or getattr(
        hf_config.get_text_config(decoder=True), "quantization_config", None)
    if quant is None:
        return {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method") or ("bitsandbytes" if quant.get("load_in_4bit") or quant.get(
        "load_in_8bit") else None)
    if method not in DEQUANTIZED_METHODS:
        raise ValueError(
            f"EngineConfig.model={config.model!r} is a quantized checkpoint (quantization_config.quant_method="
            f"{method!r}), which the rollout engine does not serve: its quantized layers are not verified exact "
            "against transformers, and a trainer's full-precision weights cannot be copied into them. Serve the "
            f"unquantized (e.g. bfloat16) checkpoint, or one of quant_method {list(DEQUANTIZED_METHODS)}, which "
            "the engine dequantizes on load")
    return {"quantization_config": AutoQuantizationConfig.from_dict({**quant, "dequantize": True})}


@contextlib.contextmanager
def _load_errors(config: EngineConfig) -> Iterator[None]:
    """transformers' loading errors as ValueErrors that name the model directory, or the flag it needs."""
    try:
        yield
    except (OSError, KeyError, SafetensorError) as err:  # SafetensorError: a truncated or corrupt weights file
        raise ValueError(f"cannot load a causal LM from {config.model!r}: {err}") from err
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(f"EngineConfig.model={config.model!r} needs the Python code it ships (config.json "
                         "auto_map); it runs only with EngineConfig.trust_remote_code=True") from err


def _refuse_remote_model_code(hf_config: transformers.PretrainedConfig, trust_remote_code: bool) -> None:
    """Trusted, a checkpoint's own model class (config.json auto_map) would replace transformers' class for
    its type, the code the engine is verified against; refused, before its weights load."""
    remote = (getattr(hf_config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if trust_remote_code and remote:
        raise refuse(hf_config.model_type, f"the checkpoint's own modelling code (auto_map AutoModelForCausalLM="
                     f"{remote!r}) in place of transformers'; with trust_remote_code=False transformers' own "
                     f"{hf_config.model_type!r} class loads")


def _logits_only(hf_config: transformers.PretrainedConfig) -> None:
    """Switch off the extra outputs a trainer's saved config may ask for (router logits for an auxiliary loss,
    hidden states, attention maps): the engine reads only the logits, and transformers hands such flags to
    every attention call."""
    for cfg in (hf_config, hf_config.get_text_config(decoder=True)):
        for flag in ("output_router_logits", "output_hidden_states", "output_attentions"):
            if getattr(cfg, flag, False):
                setattr(cfg, flag, False)
