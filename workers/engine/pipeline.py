"""Async batching: a launched step whose sampled tokens are still on their way to the host.

Each sampling row of a launched step leaves a placeholder, `-1 - row`, as the next token of its
sequence. The next step is scheduled from the placeholders (lengths are all the host needs) and takes
their tokens on the device (`plan_step` sends where each sits and which row fills it); collecting the
step then writes the real tokens over them. A placeholder is always its sequence's last token: a
sequence samples again only in a step launched after this one is collected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engine.sequence import Sequence


def placeholder(row: int) -> int:
    """The token a sequence holds until sampling row `row` of the step in flight is collected."""
    return -1 - row


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
    """A launched, uncollected step: its results, the weights version that computes them, and each
    sequence holding a placeholder with the row that fills it."""

    sampled: Sampled
    version: int
    seqs: list[Sequence] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def hold(self, seq: Sequence, row: int) -> None:
        """Give `seq` the placeholder of sampling row `row`."""
        seq.token_ids.append(placeholder(row))
        self.seqs.append(seq)
        self.rows.append(row)

    def collect(self) -> list[tuple[Sequence, int]]:
        """Wait for the results, write each held sequence's token and logprob in (with the version);
        returns the sequences and their tokens."""
        tokens, logprobs = self.sampled.wait()
        out = []
        for seq, row in zip(self.seqs, self.rows, strict=True):
            token = seq.token_ids[-1] = tokens[row]
            seq.logprobs.append(logprobs[row])
            seq.versions.append(self.version)
            out.append((seq, token))
        return out
