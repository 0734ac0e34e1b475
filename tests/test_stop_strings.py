"""Stop strings (`SamplingParams.stop`): a sample ends at the token whose text completes one, that token
kept; the same with async batching and forks; refused, before any work, where nothing can read them."""

from __future__ import annotations

import json
import logging
import re
import shutil
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollout import SamplingParams
from tests.conftest import make_engine, random_prompts, run
from workers.engine import tokenizer as tokenizer_module
from workers.engine.rows import sample_row
from workers.engine.stop_strings import StopStrings
from workers.engine.tiny_models import _CORPUS, EOS, PAD
from workers.engine.tokenizer import load_tokenizer

PROMPTS = random_prompts(3, 512, (4, 12), seed=3)
SAMPLED = dict(n=2, temperature=1.0, seed=11, max_new_tokens=40, ignore_eos=True)


def free_run(path: str) -> dict:
    """The samples without stop strings: what the stopped ones must be prefixes of."""
    return run(make_engine(path), PROMPTS, SamplingParams(**SAMPLED))


def a_stop_string(tokenizer, tokens: list[int]) -> str:
    """Three characters of the sample's text that first appear with its 20th token, or later."""
    for end in range(20, len(tokens) + 1):
        before = tokenizer.decode(tokens[:end - 1], skip_special_tokens=True)
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        if len(text) >= len(before) + 1 and len(text) >= 3 and text[-3:] not in before:
            return text[-3:]
    pytest.skip("no fresh three-character text in this sample")


@pytest.mark.parametrize("async_batching", [False, True])
def test_a_sample_ends_at_the_token_completing_its_stop_string(model_dir, async_batching):
    path = model_dir("qwen3")
    tokenizer, _ = load_tokenizer(make_engine(path).config)
    free = free_run(path)
    stop = a_stop_string(tokenizer, free[(0, 1)]["token_ids"])
    rows = run(make_engine(path, async_batching=async_batching), PROMPTS, SamplingParams(**SAMPLED, stop=[stop]))
    for key, row in rows.items():
        want = free[key]["token_ids"]
        got = row["token_ids"]
        assert got == want[:len(got)], f"sample {key} is the free sample's beginning"
        if row["finish_reason"] == "stop":
            assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1]), key
            assert stop in row["text"]
        else:
            assert row["finish_reason"] == "length" and got == want and stop not in tokenizer.decode(got), key
    assert rows[(0, 1)]["finish_reason"] == "stop" and len(rows[(0, 1)]["token_ids"]) >= 20


@pytest.mark.parametrize("clean_up", [False, True], ids=["rust-batch", "batch_decode"])
def test_a_string_is_completed_only_by_its_last_token(model_dir, clean_up):
    """Never with the prompt's text ("fo" + "x" is no "fox"); also for a tokenizer that cleans up spaces when
    decoding, read through its own `batch_decode`."""
    tokenizer, _ = load_tokenizer(make_engine(model_dir("qwen3")).config)
    tokenizer.clean_up_tokenization_spaces = clean_up
    prompt = tokenizer.encode("A dog and a fo")
    tokens = prompt + tokenizer.encode("x jumps over the lazy dog.")
    prefixes = [tokens[:end] for end in range(len(prompt) + 1, len(tokens) + 1)]
    hits = StopStrings(tokenizer).completed([(p, len(prompt)) for p in prefixes], [["fox", "dog"]] * len(prefixes))
    completed = [tokenizer.decode(p[len(prompt):]) for p, hit in zip(prefixes, hits) if hit]
    assert completed == ["x jumps over the lazy dog"]


def test_a_string_spread_over_many_tokens_is_found(model_dir):
    """Characters of three byte-level tokens each, and a string split by special tokens that decode to nothing:
    each is found at the token completing it, in one batch of every prefix (a tail of a fixed number of
    tokens, twice the string's characters and 8, missed both)."""
    tokenizer, _ = load_tokenizer(make_engine(model_dir("qwen3")).config)
    prompt = tokenizer.encode("Q:")
    cases = [(tokenizer.encode("some words 答案结束了请停止生成 tail"), "答案结束了请停止生成"),
             (tokenizer.encode("x ab") + [tokenizer.eos_token_id] * 20 + tokenizer.encode("cd e"), "abcd")]
    for generated, stop in cases:
        texts = ["", *(tokenizer.decode(generated[:end], skip_special_tokens=True)
                       for end in range(1, len(generated) + 1))]
        want = [stop in text and stop not in before for before, text in zip(texts, texts[1:])]
        samples = [(prompt + generated[:end], len(prompt)) for end in range(1, len(generated) + 1)]
        assert StopStrings(tokenizer).completed(samples, [[stop]] * len(samples)) == want and sum(want) == 1, stop


def test_a_run_of_special_tokens_is_not_decoded_again_every_step(model_dir, monkeypatch):
    """With `ignore_eos` a sample may emit EOS after EOS: a token that decodes to nothing completes no string,
    so such a step decodes nothing of the sample (its tail would widen over the whole run, every step)."""
    tokenizer, _ = load_tokenizer(make_engine(model_dir("qwen3")).config)
    decoded = []
    decode = tokenizer_module.decode
    monkeypatch.setattr(tokenizer_module, "decode", lambda tok, batch: decoded.append(sum(map(len, batch))) or decode(
        tok, batch))
    prompt = tokenizer.encode("Q:")
    tokens = prompt + tokenizer.encode("some text") + [tokenizer.eos_token_id] * 2000
    assert StopStrings(tokenizer).completed([(tokens, len(prompt))], [["</answer>"]]) == [False]
    assert sum(decoded) <= len(tokenizer.all_special_ids)


def test_a_special_tokens_own_text_as_a_stop_string_ends_the_sample_at_it(model_dir, tmp_path):
    """`stop=["<|im_end|>"]` (a special token, which the text leaves out) stops at that token, as `generate`'s
    stop_strings do, for a named special token and one only the added vocabulary marks special (Llama 3's
    `<|eom_id|>`); it was never found, so such a sample ran to its length."""
    tokenizer, _ = load_tokenizer(make_engine(model_dir("qwen3")).config)
    tokenizer.backend_tokenizer.add_special_tokens([AddedToken("<|eom_id|>", special=True)])
    tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    assert eom not in tokenizer.all_special_ids and tokenizer.decode([eom], skip_special_tokens=True) == ""
    prompt, words = tokenizer.encode("Q:"), tokenizer.encode(" some words")
    stops = StopStrings(tokenizer)
    for token, stop in [(tokenizer.eos_token_id, EOS), (eom, "<|eom_id|>")]:
        samples = [(prompt + [token], len(prompt)), (prompt + words + [token], len(prompt)),
                   (prompt + words, len(prompt)), (prompt + [token], len(prompt) + 1)]
        assert stops.completed(samples, [[stop, "xyz"]] * 4) == [True, True, False, False], stop
        assert stops.completed(samples[:2], [["xyz"], [PAD]]) == [False, False]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_stop_strings_without_a_tokenizer_are_refused_before_any_work(zoo_dir, family):
    """The zoo's models come without tokenizer files; for Qwen3 and GPT-2 transformers 5 still builds an
    empty tokenizer, which must count as none: text is null and strings are refused, not matched never."""
    engine = make_engine(zoo_dir(family))
    assert engine.tokenizer is None
    prompts = random_prompts(2, 128, (4, 12))
    assert engine.generate(prompts, SamplingParams(max_new_tokens=2)).column("text").null_count == 2
    with pytest.raises(ValueError, match="is a string, but model .* has no tokenizer"):
        engine.generate(["hello"], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs the model's tokenizer"):
        engine.generate(prompts, SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs the model's tokenizer"):
        engine.add_request(prompts[0], SamplingParams(stop=["x"]))
    assert engine.stats()["waiting"] == 0


@pytest.mark.parametrize("stop", [[""], "abc", [1]])
def test_bad_stop_strings_are_refused_naming_the_value(stop):
    with pytest.raises(ValueError, match="SamplingParams.stop="):
        SamplingParams(stop=stop)


@pytest.fixture(scope="module")
def metaspace_model(model_dir, tmp_path_factory) -> str:
    """The tiny Llama with a SentencePiece-style tokenizer (Metaspace, as Llama 2 and Mistral ship one), whose
    decode drops the leading space of its first word."""
    path = tmp_path_factory.mktemp("metaspace")
    shutil.copytree(model_dir("llama"), path, dirs_exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainers.BpeTrainer(vocab_size=400,
                                                                        special_tokens=[EOS, PAD, "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token="<unk>")
    fast.add_tokens([f"<|extra_{i}|>" for i in range(512 - len(fast))])
    fast.save_pretrained(path)
    return str(path)


def test_text_and_stop_strings_keep_the_space_a_completion_starts_with(metaspace_model):
    """A row's text is what it adds to its prompt's (as vLLM's is), so prompt text + text is the decode of
    both, with the space before the completion's first word; a stop string starting with it is found."""
    engine = make_engine(metaspace_model)
    tok = engine.tokenizer
    prompt = tok("The capital of France is")["input_ids"]
    params = dict(n=16, max_new_tokens=4, seed=0, ignore_eos=True)
    rows = run(engine, [prompt], SamplingParams(**params))
    head = tok.decode(prompt, skip_special_tokens=True)
    spaced = [row for row in rows.values() if row["text"].startswith(" ")]
    for row in rows.values():
        assert head + row["text"] == tok.decode(prompt + row["token_ids"], skip_special_tokens=True)
    assert spaced, "no sample starts with a word"
    first = tok.decode(prompt + spaced[0]["token_ids"][:1], skip_special_tokens=True)[len(head):]
    stopped = run(engine, [prompt], SamplingParams(**params, stop=[first]))[(0, spaced[0]["sample_index"])]
    assert (stopped["finish_reason"], stopped["token_ids"]) == ("stop", spaced[0]["token_ids"][:1])


def test_a_stop_string_holding_a_special_token_beside_text_is_refused(model_dir):
    """The text leaves special tokens out, so "</answer><|im_end|>" could never be found: refused before any
    work, naming the string and the token; the token's text alone is a stop string that works."""
    engine = make_engine(model_dir("qwen3"))
    prompt = random_prompts(1, 512, (4, 4))[0]
    for stop in [f"</answer>{EOS}", f"{EOS} ", f"a{PAD}b"]:
        with pytest.raises(ValueError, match=f"stop='{re.escape(stop)}' holds the special token"):
            engine.generate([prompt], SamplingParams(stop=[stop]))
        with pytest.raises(ValueError, match="holds the special token"):
            engine.add_request(prompt, SamplingParams(stop=["fine", stop]))
    assert engine.stats()["waiting"] == 0
    assert engine.generate([prompt], SamplingParams(stop=[EOS, "</answer>"], max_new_tokens=2)).num_rows == 1


def test_a_tokenizer_that_fails_to_load_is_named(model_dir, tmp_path, caplog):
    """A model directory whose tokenizer files do not load (a missing package, a broken file) still serves
    token-id prompts; the log and the refusals of string prompts and stop strings say why. One without such
    files logs nothing."""
    path = shutil.copytree(model_dir("qwen3"), tmp_path / "model")
    (path / "tokenizer.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="workers.engine.tokenizer"):
        engine = make_engine(str(path))
    assert engine.tokenizer is None and f"the tokenizer of '{path}' did not load" in caplog.text
    for call in (lambda: engine.generate(["hello"], SamplingParams()),
                 lambda: engine.add_request([1, 2], SamplingParams(stop=["x"]))):
        with pytest.raises(ValueError, match=f"the tokenizer of '{path}' did not load \\(JSONDecodeError: "):
            call()
    caplog.clear()
    for name in ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]:
        (path / name).unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="workers.engine.tokenizer"):
        assert load_tokenizer(make_engine(str(path)).config) == (None, f"model '{path}' has no tokenizer")
    assert "did not load" not in caplog.text


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer as Llama 2's tokenizer.json has it: `▁` for spaces, characters out of
    its vocabulary (here all CJK) as byte tokens `<0xE6>`, decoded by Replace, ByteFallback, Fuse and Strip."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator([_CORPUS], trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"]))
    vocab, merges = trained.get_vocab(), [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>"])
    path = tmp_path_factory.mktemp("byte_fallback")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>").save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def row_text(tok: PreTrainedTokenizerFast, prompt: list[int], generated: list[int]) -> str:
    """The `text` of the row of a sample that generated `generated` after `prompt`."""
    group = SimpleNamespace(prompt_token_ids=prompt, request_id="r", prompt_index=0,
                            params=SimpleNamespace(return_token_versions=False))
    seq = SimpleNamespace(group=group, token_ids=prompt + generated, num_prompt_tokens=len(prompt),
                          logprobs=[0.0] * len(generated), versions=[0], num_preemptions=0)
    return sample_row(seq, 0, "length", 0, 0, tok)["text"]


def test_text_after_a_prompt_of_byte_tokens_is_the_completions(byte_fallback_tokenizer):
    """A prompt ending in characters of byte tokens, cut inside one five tokens back: the context starts where
    its text has no U+FFFD, as vLLM's does; from there the byte-fallback decoder turned the prompt's and the
    completion's run of byte tokens into U+FFFD, every character of the row's text."""
    tok = byte_fallback_tokenizer
    prompt, generated = tok.encode("日本語"), tok.encode("本が好き", add_special_tokens=False)[1:]
    assert tok.convert_ids_to_tokens(generated[:2]) == ["<0xE6>", "<0x9C>"]
    assert row_text(tok, prompt, generated) == "本が好き"


def test_a_string_of_byte_token_characters_is_found(byte_fallback_tokenizer):
    """Characters of byte tokens, read from a tail cut inside one (the decoder turns the whole run into U+FFFD:
    no tail starts at a continuation byte) or right after a prompt ending in such characters: each string ends
    its sample at the token completing it, found in one batch of every prefix; both were missed."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("日本語")
    for text, stop in [("語のテキスト日本語", "日本語"), ("本が好き", "本が"), ("答案结束了。 tail", "。")]:
        generated = tok.encode(text, add_special_tokens=False)[1:]
        texts = [tok.decode(prompt + generated[:end], skip_special_tokens=True)[3:]
                 for end in range(1, len(generated) + 1)]
        samples = [(prompt + generated[:end], len(prompt)) for end in range(1, len(generated) + 1)]
        hits = StopStrings(tok).completed(samples, [[stop]] * len(samples))
        assert hits.index(True) == next(i for i, text in enumerate(texts) if stop in text), stop


@pytest.mark.parametrize("specials", [1, 5, 7])
def test_text_after_a_prompt_ending_in_special_tokens_keeps_its_leading_space(byte_fallback_tokenizer, specials):
    """A prompt ending in special tokens, which decode to nothing: the context reaches back to text, or a
    decoder that strips a decode's leading space (Llama 2's, Mistral's) strips the completion's, from the row's
    text and from the text stop strings are read in (the last five prompt tokens alone lost it)."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("the cat") + [tok.bos_token_id] * specials
    generated = tok.encode(" the", add_special_tokens=False)[1:]
    assert tok.decode(generated) == "the" and tok.decode(prompt + generated, skip_special_tokens=True) == "the cat the"
    assert row_text(tok, prompt, generated) == " the"
    assert StopStrings(tok).completed([(prompt + generated, len(prompt))], [[" the"]]) == [True]
