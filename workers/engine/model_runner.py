"""Loads a Hugging Face causal LM, owns its paged KV cache, and runs one packed forward per step."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from rollout.config import EngineConfig
from workers.engine.attention import ATTN_IMPLEMENTATION, AttentionMetadata, set_backend
from workers.engine.attention.selector import create_backend
from workers.engine.longrope import set_rope_step
from workers.engine.model_support import adapt_model, check_config, kv_layout
from workers.engine.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(config: EngineConfig) -> transformers.PreTrainedModel:
    """The model of `config.model` on its device, in eval mode, attention routed to the paged cache."""
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"EngineConfig.model={config.model!r} is not a model directory (no config.json)")
    try:
        check_config(transformers.AutoConfig.from_pretrained(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[config.dtype], attn_implementation=ATTN_IMPLEMENTATION)
    except (OSError, KeyError) as err:
        raise ValueError(f"cannot load a causal LM from {config.model!r}: {err}") from err
    return adapt_model(model.to(config.device).eval())


class ModelRunner:
    """Packs the tokens of a step into one sequence, runs the model, returns last-position logits."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(config)
        layers, kv_heads, head_dim = kv_layout(self.model)
        self.kv_cache = torch.zeros(layers, 2, config.num_blocks, config.block_size, kv_heads, head_dim,
                                    dtype=DTYPES[config.dtype], device=self.device)
        self.backend = create_backend(config.attention_backend, self.kv_cache)
        self.block_size = config.block_size
        self._warmup()

    def _warmup(self) -> None:
        """One token through every layer, so a model our attention can't serve fails at load."""
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(1, dtype=torch.long, device=self.device),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(1, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            max_seqlen_q=1, max_seqlen_k=1)
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        try:
            self.forward(ids, ids, meta, ids)
        except NotImplementedError as err:
            raise ValueError(f"model {self.config.model!r} ({self.model.config.model_type}): {err}") from err

    def prepare(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple:
        """input_ids, positions, metadata and the packed rows whose logits are needed."""
        input_ids, positions, lengths, seq_lens, keep, cu = [], [], [], [], [], [0]
        for seq, n in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            lengths += [len(seq.token_ids)] * n
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
            if start + n == len(seq.token_ids):
                keep.append(cu[-1] - 1)
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        dev = self.device
        block_table = torch.tensor(tables, dtype=torch.int32, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        counts = torch.tensor(num_tokens, device=dev)
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=dev), counts)
        slots = block_table[owner, pos // self.block_size].long() * self.block_size + pos % self.block_size
        meta = AttentionMetadata(slots, torch.tensor(cu, dtype=torch.int32, device=dev),
                                 torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_table,
                                 max(num_tokens), max(seq_lens))
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        set_rope_step(self.model, lengths)
        return ids, pos, meta, torch.tensor(keep, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor) -> torch.Tensor:
        """Logits `[len(keep), vocab]` of the packed rows `keep`."""
        self.backend.prepare_metadata(meta)
        set_backend(self.backend)
        try:
            out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep)
        finally:
            set_backend(None)
        return out.logits[0]

    def run(self, seqs: list[Sequence], num_tokens: list[int]) -> torch.Tensor:
        """Compute `num_tokens[i]` new tokens of each sequence; logits for those that reach their end."""
        return self.forward(*self.prepare(seqs, num_tokens))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst, in every layer, in one indexed copy."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
