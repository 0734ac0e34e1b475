"""How weights cross processes: numpy views (bfloat16 included) without copies, safetensors headers, flat
one-dtype buckets. No Ray."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.weight_format import (
    check_state_dict,
    check_unchanged,
    checkpoint_stamp,
    checkpoint_tensors,
    describe,
    from_numpy,
    pack,
    plan_buckets,
    to_numpy,
    unpack,
)

STATE = {"a": torch.randn(3, 4, dtype=torch.bfloat16), "b": torch.randn(5), "c": torch.arange(6).view(2, 3),
         "d": torch.randn(2, 2, dtype=torch.bfloat16), "e": torch.tensor(1.5, dtype=torch.float16)}


def test_numpy_round_trip_shares_memory_and_keeps_dtypes():
    arrays = to_numpy(STATE)
    assert str(arrays["a"].dtype) == "int16" and str(arrays["b"].dtype) == "float32"
    back = from_numpy(arrays, describe(STATE))
    for name, tensor in STATE.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
        assert back[name].data_ptr() == tensor.data_ptr(), "no copy on the way"


def test_buckets_group_by_dtype_and_respect_the_size():
    tensors = describe(STATE)
    buckets = plan_buckets(tensors, bucket_bytes=24)
    assert sorted(buckets) == [[0], [1], [2], [3], [4]]  # a (24 bytes) fills a bucket; c (48) gets its own
    assert plan_buckets(describe({"x": torch.zeros(2), "y": torch.zeros(2)}), bucket_bytes=16) == [[0, 1]]  # fills it
    buckets = plan_buckets(tensors, bucket_bytes=1 << 20)
    assert sorted(map(sorted, buckets)) == [[0, 3], [1], [2], [4]]
    for bucket in buckets:
        flat = pack(STATE, tensors, bucket, "cpu")
        assert flat.dim() == 1 and len({tensors[i].dtype for i in bucket}) == 1
        for name, tensor in unpack(flat.clone(), tensors, bucket).items():
            assert torch.equal(tensor, STATE[name])


def test_checkpoint_headers_describe_the_tensors(model_dir):
    path = model_dir("qwen3")
    state = load_file(f"{path}/model.safetensors")
    assert sorted(checkpoint_tensors(path), key=lambda t: t.name) == sorted(describe(state), key=lambda t: t.name)
    with pytest.raises(ValueError, match="not a directory of \\*.safetensors"):
        checkpoint_tensors(f"{path}/missing")


def test_a_tensor_in_two_files_of_a_checkpoint_is_refused(tmp_path):
    """A stale shard beside new ones: which copy would load depends on file order, so neither does."""
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path / "model-00001.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "old.safetensors")
    with pytest.raises(ValueError, match="holds 'b' twice, in model-00001.safetensors and old.safetensors"):
        checkpoint_tensors(tmp_path)


def test_a_sparse_tensor_is_refused_by_name_before_it_is_sent():
    state = {"a": torch.zeros(2, 2), "b": torch.eye(2).to_sparse()}
    with pytest.raises(ValueError, match="'b' is a torch.sparse_coo tensor, not a dense"):
        check_state_dict(state)


def test_a_replay_refuses_a_checkpoint_with_a_shard_removed_or_rewritten(tmp_path):
    """A replacement loads an update's checkpoint again later: any change of its files since the update was
    sent (a removed shard too) refuses it, naming the files."""
    for name in ("model-1.safetensors", "model-2.safetensors"):
        save_file({name: torch.zeros(2)}, tmp_path / name)
    stamp = checkpoint_stamp(tmp_path)
    check_unchanged(str(tmp_path), stamp, 3)
    (tmp_path / "model-2.safetensors").unlink()
    with pytest.raises(ValueError, match=r"changed since version 3 was sent \(model-2.safetensors\)"):
        check_unchanged(str(tmp_path), stamp, 3)
    save_file({"other": torch.ones(3)}, tmp_path / "model-1.safetensors")
    with pytest.raises(ValueError, match=r"\(model-1.safetensors, model-2.safetensors\)"):
        check_unchanged(str(tmp_path), stamp, 3)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "64"])
def test_a_bucket_size_that_is_no_positive_int_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(f"bucket_bytes={bad!r} must be an int >= 1")):
        plan_buckets(describe(STATE), bucket_bytes=bad)
