"""Loads a Hugging Face causal LM onto its device, sizes and owns its paged KV cache, and runs one
packed forward (a decode graph's replay when one serves the step) and one sampling pass per step."""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from rollout.config import EngineConfig
from workers.engine import memory
from workers.engine.attention import AttentionMetadata, set_backend
from workers.engine.attention.selector import create_backend
from workers.engine.block_table import BlockTables
from workers.engine.fused_norm import fuse_norms
from workers.engine.graphs import DecodeGraphs, resolve
from workers.engine.kv_cache import KvCache
from workers.engine.longrope import rope_switch_length, set_rope_step
from workers.engine.model_loading import load_model
from workers.engine.model_support import adapt_model, max_model_len
from workers.engine.pipeline import Sampled
from workers.engine.sampler import RowParams, SamplingBatch, sample, sampling_batch
from workers.engine.sequence import Sequence, cdiv
from workers.engine.staging import Staging
from workers.engine.state_cache import StateCache
from workers.engine.step_inputs import StepPlan, plan_step, profile_plan
from workers.engine.warmup import capture_graphs, startup_phase, warm_up
from workers.engine.window_ring import choose_rings, ring_state_layout, ring_table, ring_views

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """A step's device inputs, and how many sampling rows it has (one per sample of each sequence that
    samples)."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    keep: torch.Tensor
    num_rows: int
    sampling: SamplingBatch
    logits_rows: torch.Tensor | None  # which kept row each sampling row reads, when forks repeat rows
    token_lengths: torch.Tensor | None = None  # per packed token, its sequence's length (per-sequence LongRoPE)


class ModelRunner:
    """Packs the tokens of a step into one sequence, runs the model, samples the kept rows."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = memory.check_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # streams, events, graph capture and Triton use the current device
        self.startup_s: dict[str, float] = {}
        with startup_phase(self.startup_s, "load", self.device):
            self.model = load_model(config)
        with startup_phase(self.startup_s, "model probe", self.device):  # fla autotunes its kernels here
            self.layout, self.mixers = adapt_model(self.model)
        self.rope_switch_length = rope_switch_length(self.model)
        self.decode_graphs = resolve(config)[1]
        hf = self.model.config.get_text_config(decoder=True)
        self.max_model_len = max_model_len(config, hf)
        self.vocab_size = hf.vocab_size
        self.block_size = config.block_size
        self.ring_blocks, self.max_chunk, self.ring_columns = 0, None, None  # rings: chosen with the cache's size
        self.staging = Staging(self.device)
        self.tables = BlockTables(config.max_num_seqs, cdiv(self.max_model_len, config.block_size),
                                  config.block_size)
        self.row_params = RowParams(config.max_num_seqs)
        self.device_tables = (self.tables.host if self.device.type == "cpu"
                              else torch.zeros_like(self.tables.host, device=self.device))
        self.graphs: DecodeGraphs | None = None
        self.states = self._new_states()
        with startup_phase(self.startup_s, "KV cache", self.device):
            self.num_blocks = self._size_cache()
            self.kv_cache = self._new_cache(self.num_blocks)
        self.backend = create_backend(config.attention_backend, self.kv_cache)
        self._install_triton_kernels()
        with startup_phase(self.startup_s, "warm-up", self.device):
            warm_up(self)
        if self.decode_graphs:
            with startup_phase(self.startup_s, "decode graphs", self.device):
                self.graphs = capture_graphs(self)

    def _install_triton_kernels(self) -> None:
        """Where Triton runs (CUDA, or an attention backend that runs it), linear-attention layers update their
        states in place (delta_rule.py) and RMS norms run as one kernel (fused_norm.py)."""
        cuda_triton = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        runs_triton = cuda_triton or self.backend.runs_triton
        self.mixers.in_place = runs_triton
        self.fused_norms = Counter()  # norm modules of each class that run as one kernel
        if runs_triton:
            with startup_phase(self.startup_s, "fused norms", self.device):
                self.fused_norms = fuse_norms(self.model)

    def log_startup(self) -> None:
        """Log the start-up once it is complete, in total and by phase (`startup_s`)."""
        logger.info("engine start-up: %.2f s (%s)", sum(self.startup_s.values()),
                    ", ".join(f"{name} {s:.2f} s" for name, s in self.startup_s.items()))

    @property
    def graph_capture_s(self) -> float:
        """Seconds the decode graphs took to capture at start (0 without them)."""
        return self.graphs.capture_s if self.graphs is not None else 0.0

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block across every layer."""
        return self.layout.bytes_per_block(self.block_size, self.model.dtype)

    @property
    def ring_tokens(self) -> int:
        """Tokens one ring of a windowed layer holds (0: no layer keeps only its window)."""
        return self.ring_blocks * self.block_size

    def _new_cache(self, num_blocks: int) -> KvCache:
        rings = ring_views(self.states, self.layout) if self.ring_blocks else None
        return KvCache.allocate(self.layout, num_blocks, self.block_size, self.model.dtype, self.device, rings)

    def _new_states(self) -> StateCache | None:
        """The per-row state (recurrent layers' states, windowed layers' rings): a slot per block-table row, one
        for a decode graph's padding rows and, with recurrent layers, one kept zero (`StateCache`). The
        recurrent states are allocated before the KV budget is measured (on CUDA their memory then counts
        against it), the rings once it is (they come out of it)."""
        rows, slots = self.config.max_num_seqs, self.mixers.num_slots(self.config.max_num_seqs)
        rings = ring_state_layout(self.layout, self.ring_blocks, self.block_size, self.model.dtype)
        try:
            states = self.mixers.allocate(rows, self.device, rings)
        except torch.OutOfMemoryError as err:
            raise ValueError(f"the per-sequence state of max_num_seqs={self.config.max_num_seqs} sequences "
                             f"({self.mixers.nbytes(slots, rings) / 2**30:.2f} GiB) does not fit on {self.device}: "
                             "lower max_num_seqs") from err
        if states is not None:
            logger.info("per-sequence state: %d slots, %.3f GiB (%d windowed layers in rings of %d tokens)", slots,
                        states.nbytes / 2**30, len(self.layout.rings), self.ring_tokens)
        return states

    def _size_cache(self) -> int:
        """`num_blocks` as configured, or as many as the memory budget (less the windowed layers' rings, when
        they are chosen) holds; logged once."""
        sized = self.config.num_blocks is None
        num_blocks = self.config.num_blocks
        budget = self._kv_budget() if sized else num_blocks * self.bytes_per_block
        budget -= self._add_rings(budget)
        if not sized:  # the cache's layout as allocated: without the windowed layers now in rings
            memory.check_set_cache(num_blocks, num_blocks * self.bytes_per_block, self.device)
        else:
            try:
                num_blocks = memory.num_cache_blocks(self.config, budget, self.bytes_per_block, self.max_model_len)
            except ValueError as err:
                if self.states is None:
                    raise
                raise ValueError(f"{err}; or lower max_num_seqs: the per-sequence state (recurrent layers' states, "
                                 f"windowed layers' rings) takes {self.states.nbytes / 2**30:.2f} GiB, a slot per "
                                 "sequence") from err
        memory.log_cache(num_blocks, self.block_size, self.bytes_per_block, sized)
        return num_blocks

    def _kv_budget(self) -> int:
        """The memory budget (memory.kv_budget_bytes) less the recurrent states, which are allocated before it:
        a budget measured from a card's free memory has counted them already, a set or CPU one has not."""
        budget = memory.kv_budget_bytes(self.config, self._profile_peak)
        measured = self.device.type == "cuda" and self.config.kv_cache_memory_gib is None
        return budget if measured or self.states is None else budget - self.states.nbytes

    def _add_rings(self, budget: int) -> int:
        """Keep the windowed layers' last keys only, in rings, where `windowed_kv` says so (window_ring.py): the
        per-row state is allocated again with them. Returns the bytes the rings take."""
        plan = choose_rings(self.layout, self.config, self.max_model_len, budget, self.model.dtype)
        if not plan.blocks:
            return 0
        self.layout, self.ring_blocks, self.max_chunk = plan
        self.ring_columns = torch.arange(self.tables.max_blocks, dtype=torch.int32, device=self.device) % plan.blocks
        before = 0 if self.states is None else self.states.nbytes
        self.states = self.mixers.states = None  # the recurrent states are freed before they are made again
        self.states = self._new_states()
        return self.states.nbytes - before

    def _profile_peak(self) -> int:
        """Peak CUDA bytes of the model's largest step (a forward of `max_batch_tokens` tokens and
        a sampler pass over `max_num_seqs` rows), a throwaway cache of that step's blocks excluded."""
        num_tokens = min(self.config.max_batch_tokens, self.max_model_len - 1)
        cache = self._new_cache(cdiv(num_tokens, self.block_size) + 1)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.backend = create_backend(self.config.attention_backend, cache)
        inputs = self.send(profile_plan(num_tokens, self.config.max_num_seqs, self.block_size, self.ring_tokens))
        self.sample(self.forward(inputs), inputs)
        peak = torch.cuda.max_memory_allocated(self.device) - cache.nbytes
        del cache, self.backend
        torch.cuda.empty_cache()
        return peak

    def prepare(self, seqs: list[Sequence], num_tokens: list[int], prev: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs on the device, sent in one copy; block-table rows synced first. Placeholder
        tokens take their values from `prev`, the tokens the step before sampled, on the device."""
        return self.send(plan_step(seqs, num_tokens, self.tables, self.row_params,
                                    self.rope_switch_length is not None, self.ring_tokens), prev)

    def send(self, plan: StepPlan, prev: torch.Tensor | None = None) -> StepInputs:
        """A step plan's inputs on the device, in one copy; placeholder tokens filled from `prev`."""
        t = self.staging.send(plan.arrays)
        if "fill_at" in t:
            t["ids"].index_copy_(0, t["fill_at"], prev.index_select(0, t["fill_from"]))
        if self.device.type == "cuda" and plan.arrays["table_cells"].size:
            self.device_tables.view(-1)[t["table_cells"]] = t["table_values"]
        tables = self.device_tables if plan.tables is None else plan.tables.to(self.device)
        block_table = tables[:, :plan.width].index_select(0, t["rows"])
        rings = ring_table(t["rows"], self.ring_columns[:plan.width], self.ring_blocks) if self.ring_blocks else None
        meta = AttentionMetadata(t["slots"], t["cu_seqlens_q"], t["seq_lens"], block_table,
                                 plan.max_seqlen_q, plan.max_seqlen_k, rows=t["rows"],
                                 host_cu_seqlens_q=plan.arrays["cu_seqlens_q"],
                                 host_seq_lens=plan.arrays["seq_lens"], ring_slot_mapping=t.get("ring_slots"),
                                 ring_block_table=rings)
        logits_rows = t["logits_rows"] if plan.expand else None
        return StepInputs(t["ids"], t["positions"], meta, t["keep"], plan.num_rows,
                          sampling_batch(t, plan.flags), logits_rows, t.get("token_lengths"))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, use_graphs: bool = True) -> torch.Tensor:
        """Logits `[len(keep), vocab]` of the packed rows `keep`: from a decode graph when one serves the
        step (and `use_graphs`), else from one eager forward."""
        if use_graphs and self.graphs is not None and self.graphs.eligible(inputs):
            return self.graphs.replay(inputs).index_select(0, inputs.keep)
        return self.model_forward(inputs.ids, inputs.positions, inputs.meta, inputs.keep, inputs.token_lengths)

    def model_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      keep: torch.Tensor | int, token_lengths: torch.Tensor | None) -> torch.Tensor:
        """Logits of the packed rows `keep` (0: every row) of one forward; the backend serves it only."""
        self.backend.prepare_metadata(meta)
        if token_lengths is not None:
            set_rope_step(self.model, token_lengths)
        set_backend(self.backend)
        try:
            out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=keep)
        finally:
            set_backend(None)
        return out.logits[0]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        """Each sampling row's token and logprob, left on the device, with their copy to the host started."""
        if inputs.logits_rows is not None:
            logits = logits.index_select(0, inputs.logits_rows)
        return Sampled.to_host(*sample(logits, inputs.sampling))

    def launch(self, seqs: list[Sequence], num_tokens: list[int], prev: torch.Tensor | None = None) -> Sampled:
        """Queue the computation of `num_tokens[i]` new tokens of each sequence (placeholders filled from
        `prev`), and a token and its logprob for each sampling row (every wanted sample of each sequence
        that reaches its end); nothing waits for the device."""
        inputs = self.prepare(seqs, num_tokens, prev)
        logits = self.forward(inputs)
        return self.sample(logits, inputs) if inputs.num_rows else Sampled.empty(self.device)

    def adopt(self, seqs: list[Sequence]) -> None:
        """Give `seqs` their block-table rows now (before their first step: their state is copied there)."""
        for seq in self.tables.sync(seqs)[2] if seqs else ():
            self.row_params.write(seq)

    def fork_states(self, parent: Sequence, children: list[Sequence]) -> None:
        """Give a prompt's new children their rows now, each with a copy of the prompt's recurrent state
        (queued after the step that computed it); nothing without mixer layers."""
        if self.states is None or not children:
            return
        self.adopt(children)
        t = self.staging.send({"src": np.full(len(children), parent.row, np.int64),
                               "dst": np.array([child.row for child in children], np.int64)})
        self.states.copy_rows(t["src"], t["dst"])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst, in every layer, in one indexed copy."""
        if pairs:
            t = self.staging.send({"src": np.array([s for s, _ in pairs], np.int64),
                                   "dst": np.array([d for _, d in pairs], np.int64)})
            self.kv_cache.copy_blocks(t["src"], t["dst"])
