"""Every model the engine accepts is exact; every other is refused at construction, naming the feature.

Accepted: greedy tokens equal transformers `generate` (float32) for a batch mixing short and long
prompts under chunked prefill, and their logprobs equal a plain forward to 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from rollout import SamplingParams
from tests.conftest import DEVICES, hf_model, make_engine, run
from tests.model_zoo import VOCAB, ZOO, build_zoo_model, zoo_model
from workers.engine import Engine, attention, model_support
from workers.engine.longrope import uses_longrope

# linear-attention and state-space hybrids (workers/engine/recurrent.py)
HYBRID = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear",
          "lara_mini", "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3", "granitemoehybrid", "bamba", "falcon_h1",
          "nemotron_h", "nemotron_h_blocks", "jamba", "mamba2", "mamba", "falcon_mamba"]
ACCEPTED = ["llama", "llama3_rope", "llama_linear_rope", "qwen2", "qwen2_yarn", "qwen3", "mistral", "gemma2",
            "gemma3_text", "phi3", "phi3_longrope", "olmo2", "stablelm", "cohere", "granite", "starcoder2", "gpt2",
            "gpt_neox", "opt", "persimmon", "gemma", "phi", "olmo", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
            "olmo3", "smollm3", "glm", "glm4", "cohere2", "exaone4", "ernie4_5", "seed_oss", "apertus", "arcee",
            "ministral", "ministral3", "helium", "vaultgemma", "nemotron", "hunyuan_v1_dense", "hunyuan_v1_dense_alpha",
            "llama_dynamic_rope", "gpt_bigcode",
            "nanochat", "cwm", "jais2", "granitemoe", "granitemoeshared", "phimoe", "hunyuan_v1_moe", "ernie4_5_moe",
            "glm4_moe", "flex_olmo", "cohere2_moe", "exaone_moe", "afmoe", "solar_open", "dots1", "mellum", "gemma3",
            "exaone", "internlm3", "iquestcoder", "hyperclovax", "jetmoe", "minimax_m2", "hy_v3", "laguna",
            "gemma4_text", "gemma4_text_moe", "gemma4", "gemma4_unified_text", "gemma4_unified", "gemma3n_text",
            "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla", "minicpm3", "youtu", "apertus1p5_text",
            "kolibri1", "minimax_m3_vl_text", "sarvam_moe", "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash",
            "flint", "dbrx", "longcat_flash", "axk1", "qwen3_moe_router_logits", *HYBRID]
REFUSED = {
    "minimax": "layer type 'linear_attention'", "llama4_text": "chunked",
    "bloom": "ALiBi", "mpt": "ALiBi", "falcon_alibi": "ALiBi", "codegen": "AttentionInterface",
    "xglm": "AttentionInterface", "falcon": "AttentionInterface", "gptj": "AttentionInterface",
    "gpt_neo": "AttentionInterface", "recurrent_gemma": "recurrent",
    "doge": "dynamic mask attention", "phimoe_mscale_rope": "short_mscale != long_mscale",
    "llama_not_causal": r"bidirectional attention \(is_causal=False\)",
    "olmoe_stray_window": "sliding window handed to attention",
    "gemma3_bidirectional": "bidirectional attention", "gemma4_bidirectional": "bidirectional attention",
}
MOE = [name for name in ACCEPTED if "experts" in str(ZOO[name][1])]  # nested configs (text_config) too
# Families whose decode step waits on the host in every dtype (transformers 5.17, seen on an H200): Gemma 3n
# copies a CPU constant to the device in each forward; JetMoE, DBRX and LongCat-Flash dispatch their experts
# by data-dependent shapes. On a GPU their decode graphs are refused naming that line, and off by default.
HOST_SYNC = ["gemma3n_text", "jetmoe", "dbrx", "longcat_flash"]
# Short prompts, one that crosses LongRoPE's original length (32) while decoding, and long ones that
# start past it; with max_batch_tokens=16 the long ones are prefilled in chunks beside the others.
PROMPT_LENGTHS = [3, 26, 40, 5, 37]
MAX_NEW = 10


def prompts_of(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy_references(model, prompts: list[list[int]], use_cache: bool = True) -> list[list[int]]:
    """`generate`'s greedy continuation of each prompt, alone (an explicit mask: a prompt may hold the
    pad id, which `generate` would otherwise mask out). A LongRoPE model generates without a cache:
    where its cached generate recomputes at the switch to the long factors, transformers 5.17 (the
    GPU image's) feeds the last token alone and drops the context."""
    longrope = uses_longrope(model.config)
    outs = [model.generate(torch.tensor([p], device=model.device),
                           attention_mask=torch.ones(1, len(p), dtype=torch.long, device=model.device),
                           max_new_tokens=MAX_NEW, do_sample=False, use_cache=use_cache and not longrope)
            for p in prompts]
    return [out[0, len(p):].tolist() for out, p in zip(outs, prompts)]


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprob of each token from a forward pass over everything before it (the distribution that
    `generate` sampled it from; with LongRoPE one pass over the whole text would use other factors)."""
    ids = prompt + tokens
    return [torch.log_softmax(model(torch.tensor([ids[:len(prompt) + j]], device=model.device)).logits[0, -1]
                              .double(), -1)[t].item() for j, t in enumerate(tokens)]


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_model_is_exact(zoo_dir, name):
    assert_exact(zoo_dir(name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_model_is_exact_through_decode_graphs(zoo_dir, name, device):
    """Every accepted model through the padded static-buffer decode step (run eagerly on the CPU; captured
    on a GPU). On a GPU a HOST_SYNC family, whose decode step waits on the host, is refused graphs and
    checked on its default eager path."""
    if device == "cuda" and name in MOE:
        pytest.skip("float32 MoE experts cannot be captured: test_moe_decode_graphs_are_exact_in_bfloat16")
    refused = device == "cuda" and name in HOST_SYNC
    if refused:
        assert_graphs_refused(zoo_dir(name), "float32")
    engine = assert_exact(zoo_dir(name), cuda_graphs=None if refused else (False, True), device=device)
    assert engine.runner.graphs is None if refused else engine.runner.graphs.replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("name", MOE)
def test_moe_decode_graphs_are_exact_in_bfloat16(zoo_dir, name):
    """MoE experts through captured decode graphs, in bfloat16 (the one dtype torch._grouped_mm captures
    in), against a plain bfloat16 forward over the same tokens. bfloat16 noise can flip a tiny model's
    expert choice at a token, so the check is statistical: the engine's tokens are the forward's argmax
    (within 0.05) at 80% of positions or more and their logprobs agree to a median of 0.05; a stale
    buffer or a wrong graph gives nearly random tokens. (On the CPU, bfloat16 engine against forward,
    the 17 families gave 92-100% and medians of 0.001-0.018.) A HOST_SYNC family is refused graphs and
    checked on its default eager path."""
    refused = name in HOST_SYNC
    if refused:
        assert_graphs_refused(zoo_dir(name), "bfloat16")
    prompts = prompts_of(PROMPT_LENGTHS)
    engine = make_engine(zoo_dir(name), device="cuda", dtype="bfloat16", cuda_graphs=None if refused else (False, True),
                         block_size=8, max_batch_tokens=16, max_num_seqs=8)
    rows = run(engine, prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, logprobs_mode="raw"))
    assert engine.runner.graphs is None if refused else engine.runner.graphs.replays > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(zoo_dir(name), dtype=torch.bfloat16,
                                                              device_map="cuda").eval()
    gaps, diffs = [], []
    for i, prompt in enumerate(prompts):
        tokens = rows[(i, 0)]["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.double(), -1).cpu()
        got = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps.append(want.max(-1).values - got)
        diffs.append((torch.tensor(rows[(i, 0)]["logprobs"], dtype=torch.float64) - got).abs())
    assert (torch.cat(gaps) <= 0.05).double().mean() >= 0.8, "the engine's tokens are not the forward's argmax"
    assert torch.cat(diffs).median() <= 0.05, "the engine's logprobs differ from the forward's"


def test_moe_lists_every_family_whose_model_has_experts():
    """MOE is read from the zoo's config fields; a family that gets its experts from its config's defaults
    (GraniteMoeHybrid's 8, left out of MOE until the tenth GPU session's float32 graph test met them) would miss
    the bfloat16 graph test. Each model is built on the meta device, so no weights are made."""
    with_experts = []
    for name in ACCEPTED:
        if ZOO[name][0] is None:
            continue
        with torch.device("meta"):
            model = zoo_model(name)
        if any(path.rsplit(".", 1)[-1] == "experts" for path, _ in model.named_modules()):
            with_experts.append(name)
    assert with_experts == [name for name in MOE if ZOO[name][0] is not None]


@pytest.mark.parametrize("device", DEVICES)
def test_rope_recomputed_per_forward_is_made_once(zoo_dir, device):
    """PhiMoE's rotary embedding recomputes its frequencies on the CPU in every forward, a host copy that a
    CUDA graph cannot capture: the engine's model reuses one copy made on its device, with the same
    cos/sin, while a call with a `seq_len` still computes."""
    engine = make_engine(zoo_dir("phimoe"), device=device)
    rotary = engine.runner.model.base_model.rotary_emb
    first, second = rotary.rope_init_fn(rotary.config), rotary.rope_init_fn(rotary.config)
    assert first[0] is second[0] and first[0].device == rotary.inv_freq.device
    original = type(rotary)(rotary.config).to(device)
    x, positions = torch.zeros(1, 3, 8, device=device), torch.tensor([[0, 5, 9]], device=device)
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, positions), original(x, positions)))
    assert rotary.rope_init_fn(rotary.config, seq_len=4)[0] is not first[0]


def assert_graphs_refused(path: str, dtype: str) -> None:
    """A model whose decode step waits on the host: decode graphs asked for are refused naming the model's
    line that waits (by default its decode steps run eagerly: the callers check that they stay exact)."""
    with pytest.raises(ValueError, match=r"cuda_graphs=\(False, True\): the decode step waits on the host at "
                                         r"\w+/modeling_\w+\.py:\d+"):
        make_engine(path, device="cuda", dtype=dtype, cuda_graphs=(False, True), max_num_seqs=8)


def assert_exact(path: str, **config) -> Engine:
    """A batch of short and long prompts (the long ones chunked) gives `generate`'s greedy tokens, with
    the logprobs of a plain forward; returns the engine."""
    prompts = prompts_of(PROMPT_LENGTHS)
    model = hf_model(path)
    expected = greedy_references(model, prompts)
    engine = make_engine(path, block_size=8, max_batch_tokens=16, max_num_seqs=8, **config)
    rows = run(engine, prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, logprobs_mode="raw"))
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        row = rows[(i, 0)]
        assert row["token_ids"] == want, f"prompt {i} (length {len(prompt)})"
        assert row["logprobs"] == pytest.approx(forward_logprobs(model, prompt, want), abs=1e-4), f"prompt {i}"
    assert len({tuple(w) for w in expected}) > 1, "continuations are degenerate"
    return engine


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_model_is_refused_naming_the_feature(zoo_dir, name):
    model_type = ZOO[name][0].model_type
    with pytest.raises(ValueError, match=rf"model type '{model_type}'.*{REFUSED[name]}"):
        make_engine(zoo_dir(name))


def test_unverified_architecture_is_refused(tmp_path):
    """A model type nobody verified is refused, even when its attention would go through ours."""
    path = build_zoo_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="bitnet", architectures=["BitNetForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model type 'bitnet'.*not verified"):
        make_engine(path)


def test_an_attention_call_asking_for_no_causal_mask_is_refused():
    """Modelling code that passes is_causal=False, whatever its config says, is refused, not computed causally."""
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match=r"is_causal=False"):
        attention.paged_attention_forward(torch.nn.Module(), q, q, q, None, is_causal=False)


@pytest.mark.parametrize("config_class", [transformers.Qwen2_5_VLConfig, transformers.LlavaConfig,
                                          transformers.Gemma3nConfig])
def test_multimodal_model_is_refused_before_its_weights_load(tmp_path, config_class):
    """A vision-language checkpoint of a type not verified text-only (Qwen2.5-VL, LLaVA, Gemma 3n, whose
    vision tower needs timm) is refused from its config alone."""
    config_class().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model type '{config_class.model_type}'.*multimodal"):
        make_engine(str(tmp_path))


def test_attention_bias_computed_by_the_model_is_refused_even_for_a_listed_type(zoo_dir, monkeypatch):
    """Paged attention ignores `attention_mask`: a model that builds its own mask or bias (Doge's dynamic
    mask) is refused by the probe forward, even if its type were listed as supported."""
    monkeypatch.setattr(model_support, "SUPPORTED_MODEL_TYPES", model_support.SUPPORTED_MODEL_TYPES | {"doge"})
    monkeypatch.delitem(model_support._REFUSED_MODEL_TYPES, "doge")
    with pytest.raises(ValueError, match=r"model type 'doge'.*attention mask or bias computed by the model"):
        make_engine(zoo_dir("doge"))


# ---- one test per bug of issue #12 (hybrid layers and chunked attention: the refusals above) -----------

def test_longrope_sample_does_not_depend_on_its_batch(zoo_dir):
    """A short prompt alone or beside a long one, a prompt whose decoding crosses the original length
    (recomputed once, as `generate` does; so is one of exactly that length, computed with the short factors),
    and long prompts in chunks all equal `generate`."""
    path = zoo_dir("phi3_longrope")
    prompts = dict(zip(["short", "crossing", "at_switch", "long"], prompts_of([6, 26, 32, 40])))
    expected = dict(zip(prompts, greedy_references(hf_model(path), list(prompts.values()))))
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    chunked = {"max_batch_tokens": 16, "enable_prefix_caching": False}
    for names, config in [(["short"], {}), (["short", "long", "crossing", "at_switch"], {}),
                          (["long", "crossing", "at_switch"], chunked)]:
        rows = run(make_engine(path, block_size=8, **config), [prompts[n] for n in names], params)
        for i, name in enumerate(names):
            assert rows[(i, 0)]["token_ids"] == expected[name], (name, names, config)
            assert rows[(i, 0)]["num_preemptions"] == (name in ("crossing", "at_switch")), (name, names, config)


def test_longrope_prefix_cache_keeps_short_and_long_factors_apart(zoo_dir):
    """A long prompt sharing its first blocks with a short one does not reuse their short-factor KV."""
    path = zoo_dir("phi3_longrope")
    long = prompts_of([40])[0]
    short = long[:20]
    expected = greedy_references(hf_model(path), [short, long])
    engine = make_engine(path, block_size=8)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    assert run(engine, [short], params)[(0, 0)]["token_ids"] == expected[0]
    assert run(engine, [long], params)[(0, 0)]["token_ids"] == expected[1]


def test_a_window_the_attention_never_applies_follows_the_forward_pass(zoo_dir):
    """A Llama config with a stray `sliding_window`: transformers' cached `generate` drops keys older than
    the window from its cache, while the model's own forward attends to all of them. The engine follows
    the forward, which is what a trainer computes its logprobs with."""
    prompts = prompts_of(PROMPT_LENGTHS)
    model = hf_model(zoo_dir("llama_stray_window"))
    forward = greedy_references(model, prompts, use_cache=False)
    assert greedy_references(model, prompts) != forward, "the stray window changes nothing here"
    rows = run(make_engine(zoo_dir("llama_stray_window"), block_size=8), prompts,
               SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    assert [rows[(i, 0)]["token_ids"] for i in range(len(prompts))] == forward


@pytest.mark.parametrize("name", ["mamba2", "bamba", "granitemoehybrid", "falcon_h1"])
def test_a_mamba2_dt_limit_follows_the_forward_pass(zoo_dir, name):
    """transformers clamps Mamba-2's dt to `time_step_limit` in its chunked scan but not in its one-token step,
    so its cached `generate` and the model's own forward differ. The engine clamps in every step
    (mamba_step.py), following the forward: through one-token prompts and chunks, long prompts and forks.
    (Nemotron-H clamps to its `time_step_min`, 0.001 by default: test_accepted_model_is_exact at 1e-4.)"""
    path = zoo_dir(name, time_step_limit=(0.0, 0.02))
    prompts = prompts_of([1, 17, 1, 17, 33, 1, 26])
    model = hf_model(path)
    forward = greedy_references(model, prompts, use_cache=False)
    assert greedy_references(model, prompts) != forward, "the limit changes nothing here"
    rows = run(make_engine(path, block_size=8, max_batch_tokens=16, max_num_seqs=8), prompts,
               SamplingParams(n=2, temperature=0, max_new_tokens=MAX_NEW, logprobs_mode="raw"))
    for i, prompt in enumerate(prompts):
        want = forward_logprobs(model, prompt, forward[i])
        for s in range(2):
            assert rows[(i, s)]["token_ids"] == forward[i], (i, s)
            assert rows[(i, s)]["logprobs"] == pytest.approx(want, abs=1e-4), (i, s)


@pytest.mark.parametrize("name, window", [
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 4}),
    ("phimoe", {"sliding_window": 12}),
])
def test_a_window_only_the_mask_applies_is_refused(zoo_dir, name, window):
    """Qwen2-MoE and PhiMoE apply a sliding window through transformers' attention mask alone, never passing it
    to the attention call: paged attention would attend to every earlier key, so such configs are refused."""
    with pytest.raises(ValueError, match=rf"'{name}'.*a sliding window of 12 tokens that transformers applies "
                                         r"only through the attention mask \(layers \[0"):
        make_engine(zoo_dir(name, **window))


def test_a_window_as_long_as_the_context_cuts_nothing_and_is_served(zoo_dir):
    """Phi-3.5-MoE's own config: a window as long as the model's context (256 here), which no mask cuts."""
    assert_exact(zoo_dir("phimoe", sliding_window=256))


def test_paged_attention_outside_a_step_is_refused_and_leaves_the_cache_alone(zoo_dir):
    path = zoo_dir("llama")
    prompt = prompts_of([12])[0]
    engine = make_engine(path, block_size=8)
    engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    engine.step()
    (cache,) = [t.clone() for t in engine.runner.kv_cache.tensors]
    with pytest.raises(RuntimeError, match="outside an engine step"):
        engine.runner.model(torch.tensor([prompt[:5]]))
    assert torch.equal(engine.runner.kv_cache.tensors[0], cache)
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
    assert rows[0]["token_ids"] == greedy_references(hf_model(path), [prompt])[0]


def test_model_whose_tokenizer_needs_a_missing_package_loads_for_token_ids(tmp_path):
    pytest.importorskip("transformers.models.biogpt")
    try:
        import sacremoses  # noqa: F401
        pytest.skip("sacremoses is installed")
    except ImportError:
        pass
    path = build_zoo_model("llama", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BioGptTokenizer"}))
    (tmp_path / "vocab.json").write_text(json.dumps({"<s>": 0, "</s>": 1, "a": 2}))
    (tmp_path / "merges.txt").write_text("a a 1\n")
    engine = make_engine(path)
    table = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=3))
    assert len(table.column("token_ids")[0].as_py()) == 3
    with pytest.raises(ValueError, match=r"is a string, but the tokenizer of .* did not load \(ImportError: You need "
                                         "to install sacremoses"):
        engine.generate(["hello"], SamplingParams(max_new_tokens=3))
