"""`SamplingParams`: keyword and decoded construction refuse bad values and types, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n=0"), (dict(temperature=-1), "temperature=-1"), (dict(top_p=0), "top_p=0"),
    (dict(top_p=1.5), "top_p=1.5"), (dict(top_k=-2), "top_k=-2"), (dict(min_p=2.0), "min_p=2.0"),
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(logprobs_mode="x"), "logprobs_mode='x'"),
    (dict(bogus=1), "bogus"), (dict(n="8"), r"Expected `int`, got `str` - at `\$.n`"),
    (dict(top_p=1e-300), "top_p=1e-300"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_kwargs(**kwargs)


def test_numpy_and_torch_scalars_are_numbers():
    params = SamplingParams.from_kwargs(n=np.int64(4), temperature=torch.tensor(0.5), seed=np.uint64(7))
    assert (params.n, params.temperature, params.seed) == (4, 0.5, 7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=2.0), "n=2.0 is not of type int"), (dict(max_new_tokens=True), "max_new_tokens=True is not"),
    (dict(temperature=float("nan")), "temperature=nan is not of type float"),
    (dict(stop_token_ids=[1, "2"]), r"is not of type list\[int\]"),
    (dict(ignore_eos=1), "ignore_eos=1 is not of type bool"),
    (dict(seed=2**64), r"seed=18446744073709551616 must be None or in \[0, 2\*\*64\)"),
    (dict(top_k=10**30), "top_k=1000000000000000000000000000000 must be"),
    (dict(temperature=10**400), "temperature=1000"), (dict(min_p=-(10**309)), "min_p=-1000"),
])
def test_sampling_params_built_directly_are_type_checked(kwargs, match):
    """Keyword construction (msgspec checks types only when decoding) refuses ill-typed values."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
