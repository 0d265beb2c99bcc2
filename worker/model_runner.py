"""Runs steps on one rank: apply the step's deltas, build the flat batch, forward, sample."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from common.byte_size import byte_size
from protocol.engine_config import EngineConfig
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput
from worker.attention.selector import make_attention_backend
from worker.device import resolve_compute_dtype, resolve_device
from worker.distributed.tensor_parallel import TensorParallel
from worker.host.memory import available_memory
from worker.input_batch import InputBatch, StepProtocolError, as_array
from worker.kv_cache import KVCacheSize, allocate_kv_cache, determine_num_blocks
from worker.layers import bf16_linear
from worker.layers.quantization.registry import resolve_quantization
from worker.lora.manager import make_lora_manager
from worker.models import footprint
from worker.models.loader import load_model, weights_summary
from worker.models.registry import load_model_config
from worker.native.library import KernelUse
from worker.native.prebuild import libraries_for, prebuild
from worker.pooling.pooler import Pooler
from worker.pooling.pooling_head import PoolingHead
from worker.sample.metadata import SamplingMetadata
from worker.sample.rejection_sampler import RejectionSampler
from worker.sample.sampler import Sampler
from worker.sample.spec_decode_metadata import SpecDecodeMetadata
from worker.spec_decode.draft_model import DraftModelProposer, draft_model_config
from worker.step_inputs import StepInputs, prepare_step

logger = logging.getLogger("deltaserve")


class ModelRunner:
    """Holds the model, this rank's KV cache and the persistent batch.

    `execute_model` applies each `SchedulerOutput` in step order; a step number that does not
    follow the previous one raises `StepProtocolError` instead of guessing.
    """

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        if config.runner == "auto" or config.runner == "pooling" and not config.pooler_config:
            config = config.with_runner()  # resolved by the front-end as a rule
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = resolve_device(config.device, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_config = load_model_config(config.model)
        self.draft_config = draft_model_config(config)  # read once: the estimate counts it
        self.quantization = resolve_quantization(config.quantization,
                                                 self.model_config.quantization)
        self.dtype = self._compute_dtype()
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        if self.device.type == "cpu":
            self._prepare_cpu(config)
        self.attention = make_attention_backend(config.attention_backend, self.device)
        self.model = load_model(config.model, self.model_config, self.dtype, self.device,
                                self.tp, self.attention, self.max_model_len, self.quantization,
                                config.convert, config.w8a8_smoothing)
        self.weights_summary = weights_summary(self.model, self.quantization)
        self.kv_cache_spec = dataclasses.replace(
            self.model.kv_cache_spec(), hybrid=not config.disable_hybrid_kv_cache_manager)
        self.sampler = Sampler(config.seed, self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.drafter = self._make_drafter()  # a draft model, with its KV cache
        self._allocate_kv_cache()
        self.input_batch = self._make_input_batch()
        # LoRA adapters: wraps the model's targeted layers (nothing without --enable-lora)
        self.lora = make_lora_manager(self.model, self.model_config, config, self.input_batch)
        self.last_step = 0
        # The step's end, given its hidden states: sampling, or a pooling model's pooler.
        self.output_head = self._sampled_output
        # The token rows whose final states the output head reads (None: all of them).
        self.output_rows: Callable[[SchedulerOutput, StepInputs], torch.Tensor | None] = (
            lambda so, step: None)
        if config.runner == "pooling":
            self._pool_outputs()

    def _compute_dtype(self) -> torch.dtype:
        """The dtype of weights, activations and KV cache (float32 on a CPU without native
        support for the requested half dtype, and with quantized weights); residual stream
        and norms are float32."""
        config = self.config
        if self.quantization == "none":
            return resolve_compute_dtype(self.model_config.resolve_dtype(config.dtype),
                                         self.device)
        if self.device.type != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU only")
        if config.dtype not in ("auto", "float32"):
            logger.warning("--quantization %s computes in float32; --dtype %s applies to "
                           "dense weights only", self.quantization, config.dtype)
        return torch.float32

    def _make_drafter(self) -> DraftModelProposer | None:
        """The draft model where speculative decoding proposes with one."""
        if self.draft_config is None:
            return None
        drafter = DraftModelProposer(self.config.speculative_config.model, self.draft_config,
                                     self.model_config, self.dtype, self.device, self.tp,
                                     self.attention, self.max_model_len,
                                     self.sampler.generator)
        if (self.kv_cache_spec.groups()[0].sliding_window
                or any(drafter.kv_cache_spec.sliding_windows)):
            raise ValueError("a draft model needs full-attention layers in the target (its KV "
                             "follows their blocks) and none with a sliding window itself")
        return drafter

    def _allocate_kv_cache(self) -> None:
        """The KV cache (the target's, and the draft's over the same blocks) and each KV
        group's window, in the order block ids travel (empty: one full-attention group)."""
        self.kv_block_bytes = self.kv_cache_spec.bytes_per_block(self.block_size)
        if self.drafter is not None:  # its cache has the same blocks
            self.kv_block_bytes += self.drafter.kv_cache_spec.bytes_per_block(self.block_size)
        self.num_blocks = self._num_blocks()
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec, self.num_blocks,
                                           self.block_size, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(self.num_blocks, self.block_size, self.device)
        groups = self.kv_cache_spec.groups()
        self.sliding_windows = ([g.sliding_window for g in groups]
                                if len(groups) > 1 or groups[0].sliding_window else [])

    def _pool_outputs(self) -> None:
        """A pooling model's step end: its pooler over the rows it needs."""
        config = self.config
        classifier = self.model.classify if config.convert == "classify" else None
        # (LoRA deltas are per token row: the model then returns every row)
        selects = getattr(self.model, "selects_rows", False) and not config.enable_lora
        self.output_head = PoolingHead(Pooler(config.pooler_config.seq_pooling, classifier),
                                       self.input_batch, self.tp.rank == 0, selects)
        self.output_rows = self.output_head.rows_needed

    def _make_input_batch(self) -> InputBatch:
        """The persistent batch, with each layer's KV group and window."""
        spec = self.kv_cache_spec
        layer_groups = [0] * spec.num_layers
        for g, group in enumerate(spec.groups()):
            for layer in group.layers:
                layer_groups[layer] = g
        return InputBatch(self.max_model_len, self.block_size, self.device,
                          num_kv_blocks=self.num_blocks,
                          vocab_size=self.model_config.vocab_size,
                          sliding_windows=tuple(self.sliding_windows) or (0,),
                          layer_groups=tuple(layer_groups),
                          layer_windows=tuple(spec.window(i) for i in range(spec.num_layers)))

    def _prepare_cpu(self, config: EngineConfig) -> None:
        """Before the model loads: every kernel it uses compiled now (never in a step), and
        the bf16 linears' route settled: one copy where the float32 copies would not fit,
        and at TP > 1 one route for every rank (their sums share a dtype)."""
        use = KernelUse(experts=self.model_config.moe is not None
                        or config.speculative_config is not None,
                        tensor_parallel=self.tp.world_size > 1)
        prebuild(libraries_for(use), say=logger.info if self.tp.rank == 0 else None)
        if self._bf16_in_group():
            bf16_linear.agree(self.tp, self._copies_budget())

    def _bf16_in_group(self) -> bool:
        """Whether some rank may compute in bf16 (`agree` is a collective: every rank must
        answer alike). One rank: its dtype. At TP > 1 the dtype asked for, the same on every
        rank: a rank whose CPU has no native bf16 computes in float32 yet still votes."""
        if self.tp.world_size == 1:
            return self.dtype == torch.bfloat16
        requested = self.model_config.resolve_dtype(self.config.dtype)
        return self.quantization == "none" and requested == torch.bfloat16

    def _copies_budget(self) -> bf16_linear.CopiesBudget | None:
        """The whole model's bytes on this host should a bf16 model take float32 copies:
        weights (bf16), copies (float32), every rank's KV cache (bf16) as the engine will
        size it; a draft model's too (its linears take the same route)."""
        if self.dtype != torch.bfloat16:
            return None
        models = [m for m in (self.model_config, self.draft_config) if m is not None]
        ranks = self.tp.world_size
        block_bytes = sum(footprint.kv_block_bytes(m, self.block_size, ranks, 2) for m in models)
        try:
            blocks = self._kv_blocks(block_bytes, groups=1).num_blocks
        except ValueError:  # too small a budget: the allocation says so after loading
            blocks = 0
        available, source = available_memory()
        return bf16_linear.CopiesBudget(
            copies=4 * sum(map(footprint.linear_weights, models)),
            weights=2 * sum(map(footprint.weights, models)),
            kv_cache=ranks * blocks * block_bytes, available=available, source=source)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's "
                             f"max_position_embeddings={limit}")
        return wanted

    def _num_blocks(self) -> int:
        block_bytes = self.kv_block_bytes
        size = self._kv_blocks(block_bytes, groups=len(self.kv_cache_spec.groups()))
        if self.tp.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens, %s per rank (%s)", size.num_blocks,
                        self.block_size, byte_size(size.num_blocks * block_bytes), size.reason)
        return size.num_blocks

    def _kv_blocks(self, block_bytes: int, groups: int) -> KVCacheSize:
        """The KV blocks this rank holds at `block_bytes` a block: the configured budget, at
        most what max_num_seqs sequences of max_model_len tokens in `groups` groups use."""
        config = self.config
        max_useful = config.max_num_seqs * groups * -(-self.max_model_len // self.block_size) + 1
        return determine_num_blocks(
            block_bytes, self.device, max_useful=max_useful,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            gpu_memory_utilization=config.gpu_memory_utilization,
            world_size=self.tp.world_size)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        if so.step and so.step != self.last_step + 1:
            raise StepProtocolError(f"expected step {self.last_step + 1}, got step {so.step}")
        self.last_step = so.step or self.last_step
        self.input_batch.apply(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], step=so.step)
        step = prepare_step(self.input_batch, so)
        if self.output_head == self._sampled_output and step.num_drafts is None:
            # Gathered now, while numpy's code and the batch's columns are in cache: after the
            # layers stream their weights through it, the same gathers take ~10x as long.
            step.sampling = self._sampling_metadata(so, step)
        self.lora.begin_step(so, step)
        for metadata in step.metadata.groups():
            self.attention.plan(metadata)
        rows = self.output_rows(so, step)  # None: every token row's final state
        if rows is None:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata,
                                out_rows=rows)
        return self.output_head(so, step, hidden)

    def _sampled_output(self, so: SchedulerOutput, step: StepInputs,
                        hidden: torch.Tensor) -> ModelRunnerOutput:
        """A generating model's end of a step: sample, and let a draft model propose."""
        tokens, logprobs = self._sample(so, step, hidden)
        output = _output(step.req_ids, step.sampled, tokens, logprobs, so.step)
        if self.drafter is not None:
            output.draft_token_ids = self.drafter.propose(self.input_batch, step,
                                                          so.num_spec_tokens_to_propose)
        return output

    def _sample(self, so: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
                ) -> tuple[list[list[int]], list | None]:
        """Tokens (and logprobs, where asked) of the step's sampled requests, in order: one
        each in a plain step, 1 to d + 1 each once a speculative step verified their drafts.
        The persistent batch takes them."""
        sampled_rows = step.rows[step.sampled]
        if not len(sampled_rows):  # only prefill chunks short of their prompts' ends
            return [], None
        # logits_indices increase: as many as the token rows means all of them, in order
        # (every decode step), and the rows need no gather
        rows = step.logits_indices
        logits = self.model.compute_logits(hidden if len(rows) == len(hidden) else hidden[rows])
        if step.num_drafts is not None:
            return self._verify(so, step, sampled_rows, logits)
        tokens, logprobs = self.sampler.sample(logits, step.sampling)  # execute_model's
        self.input_batch.append_tokens(sampled_rows, tokens)
        return ([[token] for token in tokens],
                logprobs and [[e] if e is not None else None for e in logprobs])

    def _sampling_metadata(self, so: SchedulerOutput, step: StepInputs,
                           ) -> SamplingMetadata | None:
        """A step's sampler inputs for its sampled rows (None: nothing sampled), gathered by
        execute_model before the forward for every step _sample samples."""
        sampled_rows = step.rows[step.sampled]
        if not len(sampled_rows):
            return None
        return self.input_batch.sampling_metadata(sampled_rows, so.grammar_bitmask)

    def _verify(self, so: SchedulerOutput, step: StepInputs, sampled_rows: np.ndarray,
                logits: torch.Tensor) -> tuple[list[list[int]], list | None]:
        """A speculative step's tokens: verify each sampled request's drafts."""
        drafts = step.num_drafts[step.sampled]
        spec = SpecDecodeMetadata(drafts, as_array(so.scheduled_spec_decode_tokens.token_ids))
        if self.drafter is not None:
            spec.draft_probs = self.drafter.draft_probs(sampled_rows, spec)
        metadata = self.input_batch.sampling_metadata(np.repeat(sampled_rows, drafts + 1),
                                                      so.grammar_bitmask, spec.row_offsets())
        tokens, logprobs = self.rejection_sampler(logits, metadata, spec)
        self.input_batch.append_verified(sampled_rows, tokens, drafts)
        return tokens, logprobs


def _output(req_ids: list[int], sampled: np.ndarray, tokens: list[list[int]],
            logprobs: list | None, step: int) -> ModelRunnerOutput:
    """One list per request: the tokens of the sampled ones, nothing for the others."""
    if len(tokens) == len(req_ids):  # every request sampled: the usual decode step
        return ModelRunnerOutput(req_ids, tokens, logprobs, step=step)
    positions = np.flatnonzero(sampled).tolist()
    full: list[list[int]] = [[] for _ in req_ids]
    per_request = None if logprobs is None else [None] * len(req_ids)
    for j, i in enumerate(positions):
        full[i] = tokens[j]
        if per_request is not None:
            per_request[i] = logprobs[j]
    return ModelRunnerOutput(req_ids, full, per_request, step=step)
