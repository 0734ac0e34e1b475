"""Weight updates in a checkpoint's own layout, for every accepted family: the names and tensors that
`save_pretrained` writes, which transformers converts when it loads them; what a checkpoint holds beside the
model; the names given for one tied tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import hf_model, make_engine
from tests.test_model_coverage import ACCEPTED
from workers.engine.weights import load_source
from workers.weight_format import checkpoint_tensors, meta_state


@pytest.mark.parametrize("name", ACCEPTED)
def test_update_from_a_checkpoint_directory_loads_what_transformers_loads(zoo_dir, name):
    """A checkpoint keeps its family's original layout (GPT-NeoX's `embed_out`, one tensor per MoE expert,
    Gemma 3's `language_model.` prefix), which transformers converts on load: an update from the directory
    gives the engine, bit for bit, the weights an engine built from it holds; the service's check of the
    directory's tensor headers accepts it too."""
    old, new = zoo_dir(name), zoo_dir(name, seed=1)
    engine = make_engine(old)
    engine.validate_weights(meta_state(checkpoint_tensors(new)))
    engine.update_weights(new, version=1)
    torch.testing.assert_close(engine.state_dict(), make_engine(new).state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_checkpoint_layout_that_does_not_convert_is_refused_and_nothing_changes(zoo_dir, name):
    """One expert missing, or of another shape, in a checkpoint-layout update: a ValueError naming the layer,
    before anything is copied."""
    engine = make_engine(zoo_dir(name))
    before = {key: value.clone() for key, value in engine.state_dict().items()}
    state = dict(load_source(zoo_dir(name, seed=1)))
    expert = next(key for key in state if ".experts.1." in key)
    layer = "model.layers." + expert.split(".")[2] + ".mlp.experts."
    shrunk = {**state, expert: state[expert][:, :-1]}
    for bad in [{key: value for key, value in state.items() if key != expert}, shrunk]:
        with pytest.raises(ValueError, match=f"weights refused, nothing was changed: .*'{layer}"):
            engine.update_weights(bad, version=1)
    assert engine.policy_version == 0
    torch.testing.assert_close(engine.state_dict(), before, rtol=0, atol=0)


def test_names_transformers_ignores_on_load_are_ignored_and_no_others(zoo_dir):
    """Qwen3.5's checkpoints hold a vision tower and a multi-token-prediction head that its text-only causal LM
    leaves out on load: an update carrying them updates the rest; a name transformers would not ignore is
    still refused."""
    engine = make_engine(zoo_dir("qwen3_5"))
    state = dict(load_source(zoo_dir("qwen3_5", seed=1)))
    assert any(key.startswith("model.visual.") for key in state)
    engine.update_weights({**state, "mtp.fc.weight": torch.zeros(2, 2)}, version=1)
    torch.testing.assert_close(engine.state_dict(), make_engine(zoo_dir("qwen3_5", seed=1)).state_dict(),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="unexpected 'model.vision.extra'"):
        engine.update_weights({**state, "model.vision.extra": torch.zeros(2)}, version=2)
    assert engine.policy_version == 1


@pytest.mark.parametrize("name, alias", [("gpt_neox", "embed_out.weight"), ("qwen3_moe", ".experts.0."),
                                         ("qwen3_5", "model.language_model.")])
def test_one_tensor_under_two_names_is_refused_and_nothing_changes(zoo_dir, name, alias):
    """A checkpoint-layout name beside the model's own name for the same tensor (a stale shard in the other
    layout, say): which value would win is arbitrary, so the update is refused, by the header check too."""
    engine = make_engine(zoo_dir(name))
    before = {key: value.clone() for key, value in engine.state_dict().items()}
    both = {**dict(load_source(zoo_dir(name, seed=1))), **make_engine(zoo_dir(name, seed=2)).state_dict()}
    assert any(alias in key for key in both)
    for check in (lambda: engine.validate_weights({key: value.to("meta") for key, value in both.items()}),
                  lambda: engine.update_weights(both, version=1)):
        with pytest.raises(ValueError, match=r"weights refused, nothing was changed: '.*' is given twice, as '"):
            check()
    assert engine.policy_version == 0
    torch.testing.assert_close(engine.state_dict(), before, rtol=0, atol=0)


def test_a_checkpoint_directory_may_hold_tensors_the_model_lacks(zoo_dir, tmp_path):
    """A value head saved beside the policy (TRL's): the engine is built from such a directory, as
    `from_pretrained` ignores what the model lacks, and takes it as an update too, checked by its headers as the
    service does; a state dict carrying it is refused, and so is such a directory lacking a name, naming both."""
    new, short = tmp_path / "new", tmp_path / "short"
    state = dict(load_source(zoo_dir("llama", seed=1)))
    for path, drop in ((new, None), (short, "model.norm.weight")):
        shutil.copytree(zoo_dir("llama", seed=1), path)
        kept = {key: value for key, value in state.items() if key != drop}
        save_file({**kept, "v_head.summary.weight": torch.zeros(1, 4)}, path / "model.safetensors")
    engine = make_engine(zoo_dir("llama"))
    engine.validate_weights(meta_state(checkpoint_tensors(new)), checkpoint=True)
    engine.update_weights(str(new), version=1)
    torch.testing.assert_close(engine.state_dict(), make_engine(str(new)).state_dict(), rtol=0, atol=0)
    for refused in (lambda: engine.update_weights(dict(load_source(new)), version=2),
                    lambda: engine.validate_weights(meta_state(checkpoint_tensors(new)))):
        with pytest.raises(ValueError, match="unexpected 'v_head.summary.weight'"):
            refused()
    with pytest.raises(ValueError, match="missing 'model.norm.weight'; unexpected 'v_head.summary.weight'"):
        engine.update_weights(str(short), version=2)
    assert engine.policy_version == 1


def test_the_check_names_the_names_given_for_one_tied_tensor(model_dir):
    """The service's check returns them, so that a broadcast compares their values before sending: the tied
    pair of a model with tied embeddings, in the names they were given in; none for an untied model."""
    path = model_dir("qwen2", tie_word_embeddings=True)
    tied = make_engine(path)
    meta = {key: value.to("meta") for key, value in hf_model(path).state_dict().items()}
    assert tied.validate_weights(meta) == [["model.embed_tokens.weight", "lm_head.weight"]]
    bare = {key.removeprefix("model."): value for key, value in meta.items()}
    assert tied.validate_weights(bare) == [["embed_tokens.weight", "lm_head.weight"]]
    assert make_engine(model_dir("qwen2", tie_word_embeddings=False)).validate_weights(meta) == []
