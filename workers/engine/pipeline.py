"""Async batching: a launched step whose sampled tokens are still on their way to the host.

Each sampling row of a launched step leaves a placeholder, `-1 - row`, as the next token of its
sequence. The next step is scheduled from the placeholders (lengths are all the host needs) and takes
their tokens on the device (`plan_step` sends where each sits and which row fills it); collecting the
step then writes the real tokens over them. A placeholder is always its sequence's last token: a
sequence samples again only in a step launched after this one is collected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.sequence import Sequence, Status


@dataclass
class Sampled:
    """A step's sampled tokens on the device, and the tokens and logprobs on their way to the host."""

    tokens: torch.Tensor  # [rows] int64 on the device: the next step's placeholders are filled from it
    host: torch.Tensor  # [2, rows] float64 (pinned on CUDA): tokens and logprobs
    ready: torch.cuda.Event | None = None  # recorded after the copy to `host` (CUDA only)

    @classmethod
    def to_host(cls, tokens: torch.Tensor, logprobs: torch.Tensor) -> "Sampled":
        """Start the one device-to-host copy of a step's results; nothing waits for it here."""
        both = torch.stack([tokens.double(), logprobs.double()])
        if not both.is_cuda:
            return cls(tokens, both)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(tokens, host, ready)

    @classmethod
    def empty(cls, device: torch.device) -> "Sampled":
        """The results of a step in which no sequence samples."""
        return cls(torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(2, 0, dtype=torch.float64))

    def wait(self) -> tuple[list[int], list[float]]:
        """Each row's token and logprob, once the copy has landed (the step's one host sync)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[0].long().tolist(), self.host[1].tolist()


@dataclass
class InFlight:
    """A launched, uncollected step: its results, the weights version that computes them, and the
    sequences holding its placeholders with the row of each."""

    sampled: Sampled
    version: int
    seqs: list[Sequence]
    rows: list[int] | range

    @classmethod
    def launched(cls, sampled: Sampled, version: int, seqs: list[Sequence], rows: list[int] | range) -> "InFlight":
        """The step just launched: each of `seqs` takes its sampling row's placeholder as its next token."""
        for seq, row in zip(seqs, rows, strict=True):
            seq.token_ids.append(-1 - row)
        return cls(sampled, version, seqs, rows)

    def write(self) -> None:
        """Wait for the step's results and write each sequence's token (over its placeholder), logprob and
        weights version in. A wait that fails (Ctrl-C, a failed step) takes the placeholders back out: the
        step is lost, and a row built after it (an abort's) must not carry one as a token."""
        try:
            tokens, logprobs = self.sampled.wait()
        except BaseException:
            for seq in self.seqs:
                seq.token_ids.pop()
            raise
        for seq, row in zip(self.seqs, self.rows):
            seq.token_ids[-1] = tokens[row]
            seq.logprobs.append(logprobs[row])
            seq.versions.append(self.version)


def live_rows(samplers: list[Sequence]) -> list[int]:
    """The sampling rows of the sequences that have not finished (one that stopped in the step before the
    launched one wastes its row)."""
    rows, first = [], 0
    for seq in samplers:
        if seq.status is not Status.FINISHED:
            rows += range(first, first + len(seq.sample_indices))
        first += len(seq.sample_indices)
    return rows
