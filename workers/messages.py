"""Messages between the service and its workers (msgspec structs in an importable module, so Ray can pickle them)."""

from __future__ import annotations

import msgspec


class PromptGroup(msgspec.Struct, frozen=True):
    """One prompt of a call and the sample indices a worker must produce for it (all of range(n), or the
    ones a dead worker still owed)."""

    prompt_index: int
    token_ids: list[int]
    sample_indices: list[int]
