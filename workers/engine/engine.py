"""The engine: requests in, one continuous-batching step at a time, finished samples out."""

from __future__ import annotations

import copy
import os
import uuid

import pyarrow as pa
import torch
from tqdm.auto import tqdm

from rollout.config import EngineConfig
from rollout.params import SamplingParams, WeightSource, prompt_repeats
from rollout.schema import samples_to_batch, sort_samples
from workers.engine.batch import Batch
from workers.engine.block_pool import BlockPool, prompt_hash
from workers.engine.generation_config import eos_token_ids, warn_silent_tokenizer_eos, warn_unapplied_processors
from workers.engine.model_runner import ModelRunner
from workers.engine.offload import CpuPool
from workers.engine.pipeline import InFlight, Sampled, live_rows
from workers.engine.recurrent import without_prefix_caching
from workers.engine.request_checks import (
    check_fits,
    check_params,
    check_prompt,
    check_repeat,
    check_sample_indices,
    encode_prompts,
)
from workers.engine.rows import sample_row
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Group, Sequence, Status
from workers.engine.stop_strings import StopStrings, stopped_by_strings
from workers.engine.tokenizer import load_tokenizer
from workers.engine.warmup import startup_phase
from workers.engine.weight_swap import Rows, swap_weights, validate_source


class Engine:
    """One continuous-batching LLM engine on one device; not thread-safe (one thread drives it)."""

    def __init__(self, config: EngineConfig, worker_id: int = 0) -> None:
        self.worker_id = worker_id
        self.runner = ModelRunner(config)
        if self.runner.states is not None:
            config = without_prefix_caching(config)
        self.config = config
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(self.runner.model)
        warn_unapplied_processors(self.runner.model)
        self.tokenizer, self.no_tokenizer = load_tokenizer(config)
        self.stops = StopStrings(self.tokenizer) if self.tokenizer is not None else None
        warn_silent_tokenizer_eos(self.tokenizer, self.eos_token_ids)
        self.pool = BlockPool(self.runner.num_blocks, config.block_size)
        self.cpu_pool = self._new_cpu_pool(config)
        self.runner.log_startup()
        self.scheduler = Scheduler(config, self.pool, self.runner.tables, self.cpu_pool,
                                   self.runner.rope_switch_length, self.runner.max_chunk)
        # a step that would preempt collects the step in flight first (its one wait on the device, taken
        # earlier): a sample that stopped in it then ends instead of being preempted, as with async batching off
        self.scheduler.before_preempt = self._collect
        self.groups: dict[str, Group] = {}
        self.policy_version = 0
        self.counters = dict.fromkeys(("steps", "forks"), 0)
        on_cuda = self.runner.device.type == "cuda"
        self.async_batching = on_cuda if config.async_batching is None else config.async_batching
        self.in_flight: InFlight | None = None
        self.ready: list[dict] = []  # rows of samples collected outside `step`, handed out by the next one

    def _new_cpu_pool(self, config: EngineConfig) -> CpuPool | None:
        """The pool preempted sequences are offloaded to, when configured (pinning it is a start-up phase:
        seconds for tens of GiB)."""
        if not config.cpu_offload_gib:
            return None
        with startup_phase(self.runner.startup_s, "CPU pool", self.runner.device):
            return CpuPool(self.runner.kv_cache, config.cpu_offload_gib, self.runner.states, config.max_num_seqs,
                           self.runner.tables.array.size)

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Token ids of each prompt, validated; strings need the model's tokenizer. With `params`, each
        prompt's `params.n` samples must also fit this engine's cache."""
        out = encode_prompts(prompts, self.tokenizer, self.no_tokenizer, self.vocab_size, self.max_model_len)
        if params is not None:
            check_params(params, self.vocab_size, self.stops, self.no_tokenizer)
            for i, ids in enumerate(out):
                check_fits(self.config, self.pool.num_blocks, self.max_model_len, i, len(ids), params, params.n)
        return out

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                    request_id: str | None = None, prompt_index: int = 0,
                    sample_indices: list[int] | None = None, repeat: int = 0) -> str:
        """Queue one prompt for `params.n` samples (or only `sample_indices`); returns its request id.
        `repeat`: which copy of an identical prompt of its call this is (`rollout.params.prompt_repeats`).
        The request keeps a copy of `params`: the caller may change and reuse its object at once."""
        check_params(params, self.vocab_size, self.stops, self.no_tokenizer)
        params = copy.deepcopy(params)
        ids = check_prompt(prompt_index, prompt_token_ids, self.vocab_size, self.max_model_len)
        indices = check_sample_indices(sample_indices, params.n)
        check_repeat(repeat)
        check_fits(self.config, self.pool.num_blocks, self.max_model_len, prompt_index, len(ids), params, len(indices))
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.groups:
            raise ValueError(f"request_id={request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        max_length = min(len(ids) + params.max_new_tokens, self.max_model_len)
        group = Group(request_id, prompt_index, ids, params, seed, prompt_hash(ids), eos, max_length, len(indices),
                      repeat)
        self.groups[request_id] = group
        self.scheduler.add(Sequence(group, indices, list(ids)))
        return request_id

    def abort(self, *request_ids: str) -> list[dict]:
        """End every unfinished sample of these requests now; returns their rows (finish_reason "abort").
        The step in flight is collected first: rows of samples it finished come from the next `step`."""
        if bad := [r for r in request_ids if not isinstance(r, str)]:
            raise TypeError(f"abort(*request_ids) takes add_request's id strings, got {bad[0]!r}; unpack a list: "
                            "abort(*ids)")
        if not request_ids:
            return []
        self._collect()
        ids = set(request_ids)
        rows = self._abort([s for s in self.scheduler.sequences() if s.group.request_id in ids])
        for request_id in ids:
            self.groups.pop(request_id, None)
        return rows

    def _abort(self, seqs: list[Sequence]) -> list[dict]:
        self.scheduler.finish(seqs)
        return [self._row(seq, index, "abort") for seq in seqs for index in seq.sample_indices]

    def update_weights(self, source: WeightSource, version: int, mode: str = "continue",
                       on_rows: Rows | None = None) -> list[dict]:
        """Swap in new policy weights (a state dict or a safetensors checkpoint directory), validated first
        and copied in place; `mode` ("continue", "abort" or "finish") decides what becomes of the samples
        already started (weight_swap.py). Returns the rows of samples that ended meanwhile, or, with
        `on_rows`, hands them to it as they end and returns []."""
        return swap_weights(self, source, version, mode, on_rows)

    def validate_weights(self, source: WeightSource, checkpoint: bool = False) -> list[list[str]]:
        """Raise the ValueError `update_weights` would (names, shapes, dtypes); copies nothing. Tensors on
        the "meta" device are enough (with `checkpoint`, standing for a checkpoint directory's). Returns the
        groups of given names the model ties into one tensor: a sender checks they carry one value."""
        return validate_source(self.runner.model, source, checkpoint)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's current weights by name (the parameters themselves, not copies)."""
        return self.runner.model.state_dict()

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or offloaded, or has rows not handed out yet."""
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.ready)

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[dict]:
        """Launch one batch; returns the rows of the samples that finished in the step collected now:
        this one, or with async batching the one before, which ran while this one was prepared."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.in_flight is None and self.scheduler.has_unfinished():
                raise RuntimeError("no request can be scheduled: the KV cache is too small for any of them")
            self._collect()
            return self._take_ready()
        if self.cpu_pool:
            self._move_offloaded(batch)
        samplers = batch.samplers()
        prev = self.in_flight.sampled.tokens if self.in_flight else None
        sampled = self.runner.launch(batch.seqs, batch.num_tokens, prev)
        self.counters["steps"] += 1
        self._collect()
        self.in_flight = self._hold(batch, samplers, sampled)
        if not self.async_batching:
            self._collect()
        if self.config.check_integrity:
            self.check_integrity()
        return self._take_ready()

    def _move_offloaded(self, batch: Batch) -> None:
        """Queue the step's copies to the CPU pool, then back; a restored sequence with recurrent state
        takes its row first, for its state to go there."""
        self.cpu_pool.copy_to_cpu(batch.offload_copies, batch.state_offloads)
        self.runner.adopt([seq for _, seq in batch.state_restores])
        self.cpu_pool.copy_to_device(batch.restore_copies, [(slot, seq.row) for slot, seq in batch.state_restores])

    def _hold(self, batch: Batch, samplers: list[Sequence], sampled: Sampled) -> InFlight:
        """Count the launched step in, fork the prompts that sampled in it, and give each sampling row's
        sequence its placeholder, `-1 - row` (pipeline.py). One that reaches its length with it ends now,
        its row waiting for the token: its blocks go back to the pool while the step still writes them,
        but a later step that reuses them runs after it on the same stream, and the CPU pool's copies
        wait for that stream."""
        rows = None
        if self.scheduler.update(batch):
            rows = live_rows(samplers)
            samplers = [seq for seq in samplers if seq.status is not Status.FINISHED]
        seqs = self._fork(samplers)
        flight = InFlight.launched(sampled, self.policy_version, seqs, rows or range(len(seqs)))
        self.scheduler.finish([seq for seq in seqs if len(seq.token_ids) >= seq.group.max_length])
        return flight

    def _collect(self) -> bool:
        """Wait for the step in flight, if any, write its tokens, logprobs and version in, and end the
        samples that stopped or reached their length; their rows wait in `ready`. True if there was one."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return False
        flight.write()
        strings, stopped = stopped_by_strings(self.stops, flight.seqs), []
        for seq in flight.seqs:
            ended = seq.status is Status.FINISHED  # it reached its length at launch
            stop = seq.token_ids[-1] in seq.group.stop_token_ids or id(seq) in strings
            if stop and not ended:
                stopped.append(seq)
            if stop or ended:
                self.ready.append(self._row(seq, seq.sample_indices[0], "stop" if stop else "length"))
        self.scheduler.finish(stopped)
        return True

    def _take_ready(self) -> list[dict]:
        rows, self.ready = self.ready, []
        return rows

    def _fork(self, seqs: list[Sequence]) -> list[Sequence]:
        """Split every unforked sequence into one sequence per sample index; returns the sequences
        in the order of their sampling rows."""
        if not [seq for seq in seqs if len(seq.sample_indices) > 1]:
            return seqs
        out, copies = [], []
        for seq in seqs:
            out.append(seq)
            if seq.is_forked:
                continue
            first, *rest = seq.sample_indices
            children = [seq.fork(i) for i in rest]
            copies += self.scheduler.fork(seq, children)
            self.runner.fork_states(seq, children)
            seq.sample_indices = [first]
            self.counters["forks"] += len(children)
            out += children
        self.runner.copy_blocks(copies)
        return out

    def _row(self, seq: Sequence, sample_index: int, reason: str) -> dict:
        """The row of an ended sample; its request is forgotten with its last sample."""
        group = seq.group
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            self.groups.pop(group.request_id, None)
        return sample_row(seq, sample_index, reason, self.worker_id, self.policy_version, self.tokenizer)

    # ---- whole calls and introspection ------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                 use_tqdm: bool = False) -> pa.Table:
        """Every sample of every prompt, rows ordered by prompt then sample. It steps the engine until it is
        idle, so it needs an idle one: rows of requests added with `add_request` would join its table."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine: requests added with add_request() are "
                               "unfinished, and their rows would be returned as this call's; step() them to the end")
        token_lists = self.tokenize(prompts, params)
        request_ids: list[str] = []
        rows = []
        try:
            for i, (ids, repeat) in enumerate(zip(token_lists, prompt_repeats(token_lists))):
                request_ids.append(self.add_request(ids, params, prompt_index=i, repeat=repeat))
            with tqdm(total=len(token_lists) * params.n, disable=not use_tqdm, desc="samples") as bar:
                while self.has_unfinished():
                    done = self.step()
                    rows += done
                    bar.update(len(done))
        except BaseException:  # Ctrl-C or a failed step: the next call must not get this one's samples
            self.abort(*request_ids)
            self.ready = []  # the engine was idle: every row waiting is this call's
            raise
        return sort_samples(pa.Table.from_batches([samples_to_batch(rows)]))

    def stats(self) -> dict[str, int]:
        """Counters since start, the weights version, and the block pools' current state."""
        cpu = self.cpu_pool
        return {**self.counters, **self.scheduler.stats(), "policy_version": self.policy_version,
                "blocks_total": self.pool.num_blocks, "blocks_free": len(self.pool.free),
                "blocks_cached": len(self.pool.cached), "cpu_blocks_total": cpu.num_blocks if cpu else 0,
                "cpu_blocks_used": cpu.num_used if cpu else 0}

    def check_integrity(self) -> None:
        """Assert that block accounting balances, the block tables are exact and the zero state slot is
        zero (tests call this after every step; it holds with a step in flight too)."""
        self.scheduler.check_integrity()
        if self.runner.states is not None:
            self.runner.states.check_integrity()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; KV already computed is never matched again."""
        self.pool.reset_prefix_cache()

