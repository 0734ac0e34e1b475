"""The kinds of bad input the property tests put through the public entries, and the check each gets:
refused with an error that names the bad value or field."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

VOCAB, MAX_LEN = 512, 1024  # the tiny qwen3 model of the tests
KINDS: dict[str, set[str]] = {}  # entry (e.g. "rollout.sample") -> the kinds of bad input tried on it
RAN: set[str] = set()  # node ids of the tests this process ran (tests/conftest.py)
LEFT_OUT: set[Path] = set()  # the files of tests that `-k` or `-m` left out (tests/conftest.py)


@contextmanager
def refused(entry: str, kind: str, names: object, error: type[BaseException] = ValueError) -> Iterator[None]:
    """Expect `error` with `names` in the message (a compiled pattern, or its str matched literally); count
    the kind as tried."""
    KINDS.setdefault(entry, set()).add(kind)
    with pytest.raises(error, match=names if isinstance(names, re.Pattern) else re.escape(str(names))):
        yield


def report(entries: list[str], minimum: int, request: pytest.FixtureRequest) -> int:
    """Print the kinds tried on each of `entries` and assert at least `minimum` in all; returns the total. The
    kinds are this process's: where pytest-xdist ran some of the module's tests in another (or `-k` left some
    out), a count short of `minimum` skips the check, saying so."""
    total = sum(len(KINDS.get(entry, ())) for entry in entries)
    for entry, kinds in sorted((e, KINDS.get(e, set())) for e in entries):
        print(f"{entry}: {len(kinds)} kinds of bad input refused: {', '.join(sorted(kinds))}")
    print(f"bad-input kinds refused through {', '.join(entries)}: {total}")
    module = [item.nodeid for item in request.session.items if item.path == request.node.path]
    elsewhere = [nodeid for nodeid in module if nodeid not in RAN and nodeid != request.node.nodeid]
    if total < minimum and (elsewhere or request.node.path in LEFT_OUT):
        pytest.skip(f"some of this module's tests ran in another process or not at all, so the {total} kinds "
                    f"counted here are not all; the minimum ({minimum}) is checked where the module runs whole")
    assert total >= minimum, KINDS
    return total


ids = st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=6)
# kind -> strategy of (bad prompt, the text its error must hold, with {i} its index)
BAD_PROMPTS = {
    "empty prompt": st.sampled_from([([], "prompt {i} is empty"), ("", "prompt {i} is empty")]),
    "negative token id": st.integers(max_value=-1).map(lambda t: ([5, t], f"prompt {{i}} has token id {t} ")),
    "token id beyond the vocabulary": st.integers(VOCAB, 2**70).map(
        lambda t: ([t, 5], f"prompt {{i}} has token id {t} outside the vocabulary")),
    "token id not an int": st.sampled_from([1.5, None, "7", True, [3], b"x", np.float32(2), torch.tensor(True),
                                            torch.tensor(2.0)]).map(
        lambda t: ([5, t], f"prompt {{i}} has {t!r}, which is not an integer token id")),
    "prompt of the model's length or more": st.integers(MAX_LEN, MAX_LEN + 50).map(
        lambda n: ([7] * n, f"prompt {{i}} has {n} tokens")),
    "prompt of a wrong type": st.sampled_from([None, 5, 2.0, {"ids": [1]}, b"ab", (t for t in [5])]).map(
        lambda p: (p, f"prompt {{i}} must be a string or a list of token ids, got {type(p).__name__}")),
    "text the tokenizer cannot encode": st.sampled_from(["bad \udc80 text", "\ud800"]).map(
        lambda p: (p, "prompt {i} cannot be encoded by the tokenizer")),
}
