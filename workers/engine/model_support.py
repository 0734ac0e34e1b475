"""Which models the engine serves exactly, and the shape of their paged KV cache (model_loading.py loads them).

A model is accepted only if its type is in `SUPPORTED_MODEL_TYPES` (each one verified token for token
against transformers `generate`; a vision-language type there is served text-only: Gemma 3's or 4's
vision tower loaded but never run, Qwen3.5's left out as transformers' causal LM leaves it) and its config
uses no feature our paged attention cannot see: chunked or bidirectional attention, ALiBi,
batch-dependent RoPE, a sliding window applied by the attention mask alone, linear-attention or state-space
layers of a type not verified (those verified keep their state in recurrent.py). Everything else is refused at
construction with a `ValueError` naming the model type and the feature.
"""

from __future__ import annotations

import inspect
import traceback

import torch
import transformers

from rollout.config import EngineConfig
from workers.engine.attention import AttentionBackend, set_backend
from workers.engine.checkpoint_files import storage
from workers.engine.kv_cache import KvCache, KvLayout
from workers.engine.latent import install_latent_attention
from workers.engine.longrope import install_per_sequence_longrope
from workers.engine.recurrent import Mixers
from workers.engine.rope_cache import cache_rope_init, freeze_dynamic_rope

_SLIDING_MASK = "create_sliding_window_causal_mask"  # transformers' masking_utils, as modeling modules import it
# Model types verified exact in tests/test_model_coverage.py.
SUPPORTED_MODEL_TYPES = frozenset({
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "stablelm", "cohere",
    "granite", "starcoder2", "gpt2", "gpt_neox", "opt", "persimmon",
    "gemma", "phi", "olmo", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
    "olmo3", "smollm3", "glm", "glm4", "cohere2", "exaone4", "ernie4_5", "seed_oss", "apertus", "arcee", "ministral",
    "ministral3", "helium", "vaultgemma", "nemotron", "hunyuan_v1_dense", "gpt_bigcode", "nanochat", "cwm", "jais2",
    "granitemoe", "granitemoeshared", "phimoe", "hunyuan_v1_moe", "ernie4_5_moe", "glm4_moe", "flex_olmo",
    "cohere2_moe", "exaone_moe", "afmoe", "solar_open", "dots1", "mellum", "gemma3", "exaone", "internlm3",
    "iquestcoder", "hyperclovax", "jetmoe", "minimax_m2", "hy_v3", "laguna", "gemma4_text", "gemma4",
    "gemma4_unified_text", "gemma4_unified", "gemma3n_text", "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
    "sarvam_mla", "minicpm3", "youtu", "apertus1p5_text", "kolibri1", "minimax_m3_vl_text", "sarvam_moe",
    "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "flint", "dbrx", "longcat_flash", "axk1",
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear",
    "lara_mini", "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3", "granitemoehybrid", "bamba", "falcon_h1", "nemotron_h",
    "jamba", "mamba", "mamba2", "falcon_mamba"})

_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Types whose mixers' multi-token forward always starts from zero state: their prompt chunks after the
# first run one token per call (recurrent.py).
_STEPWISE_STATE_TYPES = {"jamba", "mamba", "falcon_mamba"}
# Layers whose state recurrent.py keeps: accepted in the verified types only.
_MIXER_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid"}
# Layers without attention or state (Nemotron-H's "-" and "E" blocks): accepted in the verified types only.
_FEED_FORWARD_LAYER_TYPES = {"mlp", "moe"}
_NO_ATTENTION_INTERFACE = "attention that bypasses transformers' AttentionInterface"
# The feature that rules out a known model type, when no config field says it on its own.
_REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi position biases", "mpt": "ALiBi position biases",
    "gptj": _NO_ATTENTION_INTERFACE, "codegen": _NO_ATTENTION_INTERFACE, "xglm": _NO_ATTENTION_INTERFACE,
    "gpt_neo": _NO_ATTENTION_INTERFACE, "falcon": _NO_ATTENTION_INTERFACE,
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "doge": "dynamic mask attention (a bias computed from the values)",
}


def refuse(model_type: str, feature: str) -> ValueError:
    """The error every refusal raises, naming the model type and the unsupported feature."""
    return ValueError(f"model type {model_type!r} is not supported by the rollout engine: {feature} "
                      "(its outputs would not match transformers)")


def check_config(config: transformers.PretrainedConfig) -> None:
    """Raise `ValueError` unless `config` is a model type and feature set the engine serves exactly."""
    model_type = config.model_type
    text = config.get_text_config(decoder=True)
    features = _flagged_features(text)
    if text is not config and model_type not in SUPPORTED_MODEL_TYPES:
        features.insert(0, "a multimodal or encoder-decoder model (its decoder's config is nested, as "
                           "text_config); the engine serves text-only causal LMs")
    if model_type in _REFUSED_MODEL_TYPES:
        features.append(_REFUSED_MODEL_TYPES[model_type])
    layer_types = getattr(text, "layer_types", None) or []
    verified = _MIXER_LAYER_TYPES | _FEED_FORWARD_LAYER_TYPES if model_type in SUPPORTED_MODEL_TYPES else set()
    served = _ATTENTION_LAYER_TYPES | verified
    features += [f"layer type {t!r}" for t in sorted(set(layer_types) - served, key=str)]
    if not features and model_type not in SUPPORTED_MODEL_TYPES:
        features.append("an architecture not verified against transformers "
                        f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    if features:
        raise refuse(model_type, features[0])


def _flagged_features(config: transformers.PretrainedConfig) -> list[str]:
    """Config flags that mean our paged attention would silently compute something else."""
    found = []
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional in (True, "all"):
        found.append(f"bidirectional attention (use_bidirectional_attention={bidirectional!r})")
    if getattr(config, "is_causal", True) is False:
        found.append("bidirectional attention (is_causal=False)")
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        found.append("ALiBi position biases")
    if getattr(config, "attention_chunk_size", None):
        found.append(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_types = {rope.get("rope_type")} if "rope_type" in rope else {
        p.get("rope_type") for p in rope.values() if isinstance(p, dict)}
    if "longrope" in rope_types and ("rope_type" not in rope or config.model_type != "phi3"):
        found.append("rope type 'longrope' outside Phi-3's single rotary embedding")
    elif "longrope" in rope_types and rope["original_max_position_embeddings"] != getattr(
            config, "original_max_position_embeddings", None):
        found.append("LongRoPE with two different original_max_position_embeddings")
    if config.model_type == "phimoe" and rope.get("rope_type", "default") != "default" and (
            rope.get("short_mscale") != rope.get("long_mscale")):
        found.append(f"PhiMoE rope type {rope['rope_type']!r} with short_mscale != long_mscale, chosen by the "
                     "longest position of the whole batch")
    return found


def adapt_model(model: transformers.PreTrainedModel) -> tuple[KvLayout, Mixers]:
    """Route `model`'s linear-attention and state-space layers to per-sequence state, check what a probe
    forward sees of its attention, make its RoPE per sequence and free of per-step host copies; returns
    the layout of its paged cache and its mixers (their state shapes recorded by the probe)."""
    mixers = Mixers(model, stepwise=model.config.model_type in _STEPWISE_STATE_TYPES)
    install_latent_attention(model)
    layout = kv_layout(model, mixers.layers)
    install_per_sequence_longrope(model)
    cache_rope_init(model)
    freeze_dynamic_rope(model)
    return layout, mixers


# A model with no position limit (a state-space model has no position embeddings) serves this many tokens
# per sequence unless `max_model_len` says otherwise.
UNBOUNDED_MAX_MODEL_LEN = 32768


def max_model_len(config: EngineConfig, hf: transformers.PretrainedConfig) -> int:
    """`config.max_model_len`, or the model's `max_position_embeddings` (UNBOUNDED_MAX_MODEL_LEN for a model
    without one). A length past the model's limit is refused rather than lowered in silence (vLLM refuses it
    too, though it first extends the limit by a RoPE scaling factor, which transformers does not)."""
    limit = getattr(hf, "max_position_embeddings", None)
    if config.max_model_len is None:
        return limit or UNBOUNDED_MAX_MODEL_LEN
    if limit is not None and config.max_model_len > limit:
        raise ValueError(f"EngineConfig.max_model_len={config.max_model_len} is longer than the model's "
                         f"max_position_embeddings={limit}; lower it, or leave it unset to serve {limit}")
    return config.max_model_len


class _ShapeProbe(AttentionBackend):
    """Records the layer index and the k/v of every attention call (kept alive, so that a layer handed
    an earlier layer's K/V is seen by its storage); returns zeros."""

    def __init__(self) -> None:
        super().__init__(KvCache.of(torch.zeros(1, 2, 1, 1, 1, 1)))
        self.calls: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []
        self.windows: dict[int | None, int | None] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Record the call; the output's values do not matter."""
        self.calls.append((layer, k, v))
        self.windows[layer] = sliding_window
        return q.new_zeros(*q.shape[:2], v.shape[-1])


@torch.inference_mode()
def kv_layout(model: transformers.PreTrainedModel, mixer_layers: list[int] = ()) -> KvLayout:
    """Each layer's KV heads and head size, and whose K/V it reads, from a two-token probe forward.

    Raises `ValueError` unless every decoder layer either calls our attention exactly once with K and V
    of one shape (values narrower than keys, as in multi-head latent attention with expanded K/V, arrive
    padded; a latent layer's values are the first columns of its keys, stored once), or is one of
    `mixer_layers` (linear attention, state space; those may attend too), or is a feed-forward block by its
    config's `layer_types` (Nemotron-H's); so attention outside the interface is refused. A layer handed
    the very K/V tensors an earlier layer computed (KV sharing) reads that layer's cache.
    """
    probe = _ShapeProbe()
    model_type = model.config.model_type
    _probe_forward(model, probe)
    layers = [layer for layer, _, _ in probe.calls]
    text = model.config.get_text_config(decoder=True)
    expected = list(range(text.num_hidden_layers))
    kinds = getattr(text, "layer_types", None) or []
    feed_forward = [i for i, kind in enumerate(kinds) if kind in _FEED_FORWARD_LAYER_TYPES]
    if sorted(set(layers) | set(mixer_layers) | set(feed_forward)) != expected or len(set(layers)) != len(layers):
        raise refuse(model_type, f"{_NO_ATTENTION_INTERFACE} or non-attention layers "
                                 f"(layers calling paged attention: {layers}; state-space layers: {mixer_layers})")
    masked = _windows_only_masked(model, probe.windows)
    if masked:
        raise refuse(model_type, f"a sliding window of {masked[0]} tokens that transformers applies only through "
                                 f"the attention mask (layers {masked[1]}), which paged attention never sees")
    unmasked = _windows_never_masked(model, probe.windows)
    if unmasked:
        raise refuse(model_type, f"a sliding window handed to attention (layers {unmasked}) that the model's masks "
                                 "never apply, so transformers' attention implementations disagree on it")
    values_are_keys = frozenset(layer for layer, k, v in probe.calls if _leads(v, k))
    mismatched = [layer for layer, k, v in probe.calls if k.shape != v.shape and layer not in values_are_keys]
    if mismatched:
        raise refuse(model_type, f"keys and values of different shapes (layers {mismatched})")
    # a model without attention (Mamba) keeps a one-element placeholder K/V in layer 0, never read: blocks
    # still bound each sequence's length and are counted as ever
    shapes = {layer: tuple(k.shape[1:]) for layer, k, _ in probe.calls} or {0: (1, 1)}
    owners = dict(zip(layers, _owners(probe.calls)))
    return KvLayout(tuple(shapes.get(i) for i in expected), tuple(owners.get(i, i) for i in expected),
                    values_are_keys, tuple(probe.windows.get(i) for i in expected))


def _windows_only_masked(model: transformers.PreTrainedModel,
                         windows: dict[int | None, int | None]) -> tuple[int, list[int]] | None:
    """The window and the layers it applies to, where the config sets a sliding window shorter than the
    model's context, its modeling code builds sliding-window masks (Qwen2-MoE, PhiMoE), and the layers' attention
    calls get no window: there the window lives in the mask alone. (A window in the config that the forward
    ignores, as Llama's, is no such case: the engine follows the forward.)"""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if not window or (context and window >= context) or not hasattr(inspect.getmodule(type(model)), _SLIDING_MASK):
        return None
    types = getattr(config, "layer_types", None)
    layers = [layer for layer, seen in windows.items()
              if seen is None and (types is None or types[layer] == "sliding_attention")]
    return (window, layers) if layers else None


def _windows_never_masked(model: transformers.PreTrainedModel, windows: dict[int | None, int | None]) -> list[int]:
    """The layers whose attention calls get a window although the modeling code builds no sliding-window mask
    (a stray `sliding_window` in an OLMoE config): the eager forward attends to every key, flash-attn would not."""
    if hasattr(inspect.getmodule(type(model)), _SLIDING_MASK):
        return []
    return [layer for layer, window in windows.items() if window is not None]


def _probe_forward(model: transformers.PreTrainedModel, probe: _ShapeProbe) -> None:
    """A two-token forward with `probe` as the attention backend; a failure that says the model cannot be
    served here is raised as a `ValueError` naming why."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    set_backend(probe)
    try:
        model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False,
              logits_to_keep=1)
    except NotImplementedError as err:
        raise refuse(model.config.model_type, str(err)) from err
    except Exception as err:
        if device.type != "cpu" or not _raised_in_package(err, "fla"):
            raise
        raise ValueError(
            f"model type {model.config.model_type!r} cannot run on the CPU here: flash-linear-attention is "
            "installed, and transformers then runs its Triton kernels for the linear-attention layers on any "
            "device, where they need a GPU; run it on CUDA, or where flash-linear-attention (fla-core) is not "
            "installed") from err
    finally:
        set_backend(None)


def _raised_in_package(err: BaseException, package: str) -> bool:
    """Whether any frame of `err`'s traceback runs code of `package`."""
    return any(frame.f_globals.get("__name__", "").partition(".")[0] == package
               for frame, _ in traceback.walk_tb(err.__traceback__))


def _leads(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether values `v` are the first columns of keys `k` (latent attention), the same memory."""
    return (v.data_ptr(), v.stride(), v.shape[:-1]) == (k.data_ptr(), k.stride(), k.shape[:-1])


def _owners(calls: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    """Per layer, the first layer whose K and V are the same tensors as its own."""
    first: dict[tuple, int] = {}
    for layer, k, v in calls:
        first.setdefault((storage(k), storage(v)), layer)
    return tuple(first[storage(k), storage(v)] for _, k, v in calls)
