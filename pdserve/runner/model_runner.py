"""ModelRunner: owns the weights and the KV cache tensors; turns a step plan into sampled tokens.

`execute(plan)` builds the step's inputs once (token ids, positions, cache slots, attention
metadata) with numpy index arithmetic, runs one forward over all scheduled tokens, computes logits
only for the rows that sample, and samples them: one host sync per step for the sampled ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.kernels import huge_pages
from pdserve.kv.rows import row_width
from pdserve.models.attention import AttentionMetadata, PrefillChunk, make_backend
from pdserve.models.fused_decode import FusedDecode
from pdserve.models.kv_quant import KV_CACHE_DTYPES
from pdserve.models.loader import load_model
from pdserve.models.quant_linear import quantized_bytes_per_param
from pdserve.request import Request
from pdserve.runner.sampler import Sampler, SamplingRow, TokenMasks, is_greedy, plain_greedy
from pdserve.sched.scheduler import SchedulerOutput
from pdserve.spec.draft import Drafter
from pdserve.spec.verify import verify
from pdserve.structured.matcher import fill_bitmask, fill_proposal_bitmask
from pdserve.types import Logprob, Verdict

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


@dataclass(slots=True)
class StepResult:
    """What one step computed, for `Scheduler.update`."""

    sampled: list[int]  # one token per sampling request, in plan order
    logprobs: list[Logprob | None]
    # Requests that asked for prompt logprobs: (index of the first prompt token scored, one
    # Logprob per token scored this step).
    prompt_logprobs: dict[str, tuple[int, list[Logprob]]]
    # Requests that verified proposed tokens: what each emits (`pdserve.spec.verify`).
    speculated: dict[str, Verdict] = field(default_factory=dict)
    # A burst plan (`SchedulerOutput.num_steps` > 1): each request's tokens, one per step run
    bursts: list[list[int]] | None = None


# Prompt logprobs are computed this many positions at a time (a [rows, vocab] logits block each).
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [S] rows of the hidden states that sample, in plan order; None: every row, in order
    logits_indices: torch.Tensor | None
    rows: list[SamplingRow]
    # Requests with proposed tokens: (index in the plan, first row, end row) of their positions
    spec_rows: list[tuple[int, int, int]] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)  # each item's first row, in plan order


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str = "cpu",
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_factory=None,
        linear_backend: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        quantization: str = "none",
        group_size: int = 32,
        calibration_tokens: int = 0,
        kv_cache_dtype: str = "auto",
        draft_model: str | None = None,
        draft_layers: int | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_threads: int | None = None,
    ) -> None:
        """`kv_cache_factory(shape, dtype, device)` allocates the KV cache (default: zeros in this
        process, on huge pages on a CPU that has them; disaggregated decode workers put it in
        shared memory). `draft_model` (a folder) or `draft_layers` (the first N of this model)
        make the draft that proposes tokens for speculative decoding (`pdserve.spec.draft`).
        `tensor_parallel_size` > 1 splits the model over that many ranks, this process and
        followers it starts (`pdserve.runner.tensor_parallel`), each with
        `tensor_parallel_threads` threads (None: this process's CPUs shared out); `shard_config`
        is then this rank's shape."""
        self.config = self.shard_config = model_config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_model_len = max_model_len or model_config.max_model_len
        self.block_size = cache_config.block_size
        self.tp = None
        if tensor_parallel_size > 1:
            self.shard_config = self._start_tensor_parallel(
                tensor_parallel_size, model_config, dtype, linear_backend, attention_backend,
                seed, quantization, group_size, tensor_parallel_threads)  # fmt: skip
        torch.manual_seed(seed)
        self.model = load_model(
            model_config,
            self.device,
            self.dtype,
            self.max_model_len,
            linear_backend,
            attn_backend=make_backend(attention_backend, self.device, self.dtype),
            quantization=quantization,
            group_size=group_size,
            tp=(0, tensor_parallel_size),
            calibration_tokens=calibration_tokens,
        )
        self.matmul_bytes_per_param = quantized_bytes_per_param(self.model)
        if self.tp is not None:
            from pdserve.runner.tensor_parallel import shard_model

            shard_model(self.model, self.tp.group)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"invalid kv_cache_dtype={kv_cache_dtype!r}: choose auto or int8")
        # int8: each row carries its scale (models/kv_quant.py); auto: the model's dtype
        self.kv_dtype = torch.int8 if kv_cache_dtype == "int8" else self.dtype
        self.kv_row_width = row_width(model_config.head_dim, self.kv_dtype == torch.int8)
        self.draft_model = self.draft_config = None
        if draft_model is not None:
            self.draft_config = self._load_draft(draft_model, linear_backend, attention_backend,
                                                 enforce_eager, quantization, group_size,
                                                 calibration_tokens)  # fmt: skip
        self._use_fused_decode(enforce_eager, tensor_parallel_size)
        self.num_blocks = self._num_blocks(cache_config)
        shape = (
            model_config.num_layers,
            2,
            self.num_blocks * self.block_size,
            self.shard_config.num_kv_heads,
            self.kv_row_width,
        )
        if kv_cache_factory is None:  # decode attention reads it in place: on huge pages
            cache = huge_pages.zeros(shape, self.kv_dtype, self.device)
        else:
            cache = kv_cache_factory(shape, self.kv_dtype, self.device)
        self.kv_caches = list(cache.unbind(0))  # per layer [2, num_slots, Hkv, D]
        if self.tp is not None:
            # where the cache must be reachable (a decode worker's, in shared memory), each
            # follower's is a file made the same way, which it maps
            paths = None
            if kv_cache_factory is not None:
                made = [kv_cache_factory(shape, self.kv_dtype, self.device)
                        for _ in range(1, self.tp.size)]  # fmt: skip
                paths = [t.untyped_storage().filename for t in made]
                if None in paths:
                    raise ValueError("the KV cache factory made a cache no follower can map")
            self.tp.setup(self.num_blocks, self.block_size, self.kv_dtype, self.kv_row_width,
                          paths)  # fmt: skip
        self.sampler = Sampler(model_config.eos_token_ids)
        self.drafter = self._drafter(draft_layers)
        if self.drafter is not None:
            logger.info("speculative decoding: the draft is %s", self.drafter.name)

    def _load_draft(self, path, linear_backend, attention_backend, enforce_eager, quant, group,
                    calibration_tokens=0):  # fmt: skip
        cfg = ModelConfig.from_pretrained(path)
        if cfg.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"invalid draft_model={path!r}: its vocabulary has {cfg.vocab_size} tokens, the "
                f"model's {self.config.vocab_size} (the draft must share the tokenizer)"
            )
        self.draft_model = load_model(cfg, self.device, self.dtype, self.max_model_len,
                                      linear_backend, make_backend(attention_backend, self.device,
                                      self.dtype), quant, group,
                                      calibration_tokens=calibration_tokens)  # fmt: skip
        self.draft_model.fused_decode = None
        if not enforce_eager:
            self.draft_model.fused_decode, _ = FusedDecode.build(self.draft_model)
        return cfg

    def _drafter(self, draft_layers: int | None) -> Drafter | None:
        if draft_layers is not None:
            if not 0 < draft_layers < self.config.num_layers:
                raise ValueError(
                    f"invalid draft_layers={draft_layers}: the model has "
                    f"{self.config.num_layers} layers (choose 1 to {self.config.num_layers - 1})"
                )
            return Drafter(self.model, self.kv_caches[:draft_layers], self.layout, shared=True)
        if self.draft_model is None:
            return None
        c = self.draft_config
        shape = (c.num_layers, 2, self.num_blocks * self.block_size, c.num_kv_heads,
                 row_width(c.head_dim, self.kv_dtype == torch.int8))  # fmt: skip
        caches = torch.zeros(shape, dtype=self.kv_dtype, device=self.device).unbind(0)
        return Drafter(self.draft_model, list(caches), self.layout, shared=False)

    def _start_tensor_parallel(self, size, cfg, dtype, linear_backend, attention_backend, seed,
                               quantization, group_size, threads) -> ModelConfig:  # fmt: skip
        """Start the follower ranks; returns this rank's shape. What the ranks cannot share
        yet is refused here, before anything starts."""
        from pdserve.models.tp_shard import shard_config
        from pdserve.runner.tensor_parallel import ShardArgs, TensorParallel

        why = None
        if self.device.type != "cpu":
            why = "it runs on the CPU (gloo); NCCL on CUDA is not built"
        if why:
            raise ValueError(f"invalid tensor_parallel_size={size}: {why}")
        shard = shard_config(cfg, size)
        self.tp = TensorParallel(size, ShardArgs(cfg.path, dtype, str(self.device),
                                 self.max_model_len, linear_backend, attention_backend, seed,
                                 quantization, group_size, threads))  # fmt: skip
        return shard

    def close(self) -> None:
        """End the follower ranks, if any (they also end with this process)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    def _use_fused_decode(self, enforce_eager: bool, tensor_parallel_size: int = 1) -> None:
        if tensor_parallel_size > 1:
            why = "tensor parallel (the fused step has no all-reduce)"
        elif enforce_eager:
            why = "--enforce-eager"
        else:
            self.model.fused_decode, why = FusedDecode.build(self.model)
        if self.model.fused_decode is None:
            logger.info("decode steps run layer by layer (no fused decode step: %s)", why)
        else:
            logger.info("decode steps run fused, one native call per layer")

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of the model's KV one block holds on this rank (what offload tiers and
        transfers move; with tensor parallelism each rank holds its share of the heads)."""
        return self._block_bytes(self.shard_config)

    def _block_bytes(self, c: ModelConfig | None) -> int:
        if c is None:
            return 0
        width = row_width(c.head_dim, self.kv_dtype == torch.int8)
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * width * self.kv_dtype.itemsize

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.kv_bytes_per_block + self._block_bytes(self.draft_config)  # + the draft's
        n = cache.memory_bytes // per_block
        if n < 1:
            raise ValueError(
                f"invalid kv_cache_memory={cache.memory_bytes}: one block needs {per_block} bytes"
            )
        # More blocks than every sequence of max length could use is wasted memory.
        return int(n)

    def add_layer_hook(self, fn, wanted: Callable[[], bool] | None = None) -> None:
        """Call `fn(layer_index)` after each decoder layer's forward (its KV is then written).
        A step that needs them runs layer by layer (the fused decode step has no layer
        modules): every step, or with `wanted` only those for which it says so when their
        forward starts (a KV sender: steps that computed rows to ship)."""
        if wanted is None:
            self.model.fused_decode = None
        else:
            self.model.layer_hooks_wanted = wanted
        for i, layer in enumerate(self.model.layers):
            layer.register_forward_hook(lambda _m, _i, _o, i=i: fn(i))

    # ---- inputs --------------------------------------------------------------------------
    def _slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        bs = self.block_size
        pos = np.arange(start, end)
        return np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs

    def _slot_table(self, tables: list[list[int]], width: int) -> np.ndarray:
        """[len(tables), width] int64: row r holds the cache slots of positions 0 .. width - 1
        of the request with block table tables[r] (0 past its blocks)."""
        bs = self.block_size
        table = np.zeros((len(tables), -(-width // bs)), dtype=np.int64)
        for r, t in enumerate(tables):
            ids = t[: table.shape[1]]
            table[r, : len(ids)] = ids
        return (table[:, :, None] * bs + np.arange(bs)).reshape(len(tables), -1)[:, :width]

    def layout(
        self, runs: list[tuple[list[int], int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The inputs of a forward over `runs`, each (block table, position of its first token,
        tokens): (input ids, positions, attention metadata, the row of each run's last token).
        One-token runs become decode rows (first, in order), longer runs prefill chunks."""
        singles = [r for r, run in enumerate(runs) if len(run[2]) == 1]
        chunks = [r for r, run in enumerate(runs) if len(run[2]) > 1]
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        last_row = [0] * len(runs)
        meta = AttentionMetadata(slot_mapping=None, num_decodes=len(singles))  # type: ignore[arg-type]
        if singles:
            ctx = np.asarray([runs[r][1] + 1 for r in singles])
            max_ctx = int(ctx.max())
            all_slots = self._slot_table([runs[r][0] for r in singles], max_ctx)
            pos = ctx - 1
            positions.append(pos)
            slots.append(all_slots[np.arange(len(singles)), pos])
            meta.decode_slots = torch.from_numpy(all_slots).to(self.device)
            mask = np.arange(max_ctx)[None, :] < ctx[:, None]
            meta.decode_mask = torch.from_numpy(mask[:, None, None, :]).to(self.device)
            meta.decode_lens = torch.from_numpy(ctx.astype(np.int64)).to(self.device)
            for row, r in enumerate(singles):
                tokens.extend(runs[r][2])
                last_row[r] = row
        q = len(singles)
        for r in chunks:
            table, start, run_tokens = runs[r]
            end = start + len(run_tokens)
            tokens.extend(run_tokens)
            positions.append(np.arange(start, end))
            slots.append(self._slots(table, start, end))
            chunk = PrefillChunk(q, q + len(run_tokens), None, None)
            if start > 0:
                chunk.ctx_slots = torch.from_numpy(self._slots(table, 0, end)).to(self.device)
                mask = np.arange(end)[None, :] <= np.arange(start, end)[:, None]
                chunk.mask = torch.from_numpy(mask).to(self.device)
            meta.prefills.append(chunk)
            q += len(run_tokens)
            last_row[r] = q - 1
        meta.slot_mapping = torch.from_numpy(np.concatenate(slots)).to(self.device)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return (
            input_ids,
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            meta,
            last_row,
        )

    def prepare(self, plan: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepInputs:
        """The step's inputs. A request verifying proposals is laid out as one one-token query
        per position (its last token, then each proposal), each with its own context length."""
        items = plan.scheduled
        runs: list[tuple[list[int], int, list[int]]] = []
        first_run, last_run = [0] * len(items), [0] * len(items)
        spec_runs = []
        for i, item in enumerate(items):
            req = item.request
            n = req.num_computed_tokens
            table = block_tables[req.request_id]
            first_run[i] = len(runs)
            if item.spec_tokens:
                first = len(runs)
                runs.append((table, n, [req.all_token_ids[n]]))
                runs.extend((table, n + 1 + j, [t]) for j, t in enumerate(item.spec_tokens))
                spec_runs.append((i, first, len(runs)))
            else:
                runs.append((table, n, req.all_token_ids[n : n + item.num_new_tokens]))
            last_run[i] = len(runs) - 1
        input_ids, positions, meta, last_row = self.layout(runs)
        sample_idx = [i for i, s in enumerate(items) if s.sample and not s.spec_tokens]
        rows = [self._sampling_row(items[i].request) for i in sample_idx]
        sample_rows = [last_row[last_run[i]] for i in sample_idx]
        num_rows = len(input_ids)
        every_row = len(sample_rows) == num_rows and sample_rows == list(range(num_rows))
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logits_indices=None
            if every_row  # a decode step: no gather
            else torch.tensor(sample_rows, device=self.device),
            rows=rows,
            spec_rows=[(i, last_row[a], last_row[b - 1] + 1) for i, a, b in spec_runs],
            first_rows=[last_row[r] - len(runs[r][2]) + 1 for r in first_run],
        )

    def _sampling_row(self, req: Request) -> SamplingRow:
        params = req.sampling_params
        if params.seed is not None and req.runner_state is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            if not is_greedy(params):
                # Tokens sampled elsewhere (a prefill worker) each took one draw: skip them, so
                # the sequence is the same wherever its tokens were sampled.
                noise = torch.empty(self.config.vocab_size, device=self.device)
                for _ in range(req.num_output_tokens):
                    noise.exponential_(generator=gen)
            req.runner_state = gen
        return SamplingRow(params, req.runner_state, req.prompt_token_ids, req.output_token_ids)

    def warm_up(self, num_tokens: int, num_seqs: int) -> float:
        """One forward of a full step's prompt tokens (`num_tokens`, as chunks of at most 256)
        and one of `num_seqs` decode rows, with their logits; returns the seconds it took.

        The first step at a size pays for its memory: every activation buffer is new to the
        allocator and page-faults as it is first written. Run at startup, after
        `engine.c_heap.keep_freed_memory`, the warm-up leaves that memory mapped for the first
        request's step (the first load of `benchmarks/prefill_bench.py` took 171,000-219,000
        faults before these changes and the MLP's chunks, 200-8,400 after; docs/PERFORMANCE.md,
        "Prefill without page faults"). Its K/V go to a scratch copy of block 0; no request,
        block, cache row or statistic is touched."""
        t0 = time.perf_counter()
        span = min(256, self.max_model_len)
        runs, left = [], num_tokens
        while left > 0:
            n = min(span, left)
            runs.append(([0] * -(-n // self.block_size), 0, [0] * n))
            left -= n
        # the slots of block 0 in a scratch cache, so the real one stays untouched (a decode
        # worker's is shared with its prefill workers); tensor-parallel followers, driven by
        # the same forward, write block 0 of theirs, which no request holds yet
        scratch = [torch.zeros_like(c[:, : self.block_size]) for c in self.kv_caches]
        for batch in (runs, [([0], 0, [0])] * num_seqs):  # as `execute` runs them
            input_ids, positions, meta, last_row = self.layout(batch)
            hidden = self.model(input_ids, positions, scratch, meta)
            self.model.compute_logits(hidden[torch.tensor(last_row, device=self.device)])
        return time.perf_counter() - t0

    # ---- the step ------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        if plan.num_steps > 1:
            return self._burst(plan, block_tables)
        draft_probs = self._draft(plan, block_tables)
        inputs = self.prepare(plan, block_tables)
        masks = self._grammar_masks(plan)
        # Every row samples (a decode step; a verifying request's rows never all do): the head
        # runs in the forward's own call where it can, and where every row is plain greedy so
        # does the argmax (no sampler).
        every_row = bool(inputs.rows) and inputs.logits_indices is None
        if every_row:
            greedy = masks is None and all(map(plain_greedy, inputs.rows))
            hidden, head = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                      inputs.meta, with_logits=True, greedy=greedy)  # fmt: skip
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            head = None
        prompt_logprobs = self._prompt_logprobs(plan, hidden, inputs.first_rows)
        speculated = self._verify(plan, inputs.spec_rows, hidden, draft_probs)
        if not inputs.rows:
            return StepResult([], [], prompt_logprobs, speculated)
        if head is not None and head.greedy is not None:
            return StepResult(head.greedy, [None] * len(head.greedy), prompt_logprobs, speculated)
        if head is not None:
            logits = head.logits
        else:
            if inputs.logits_indices is not None:
                hidden = hidden[inputs.logits_indices]
            logits = self.model.compute_logits(hidden)
        out = self.sampler(logits, inputs.rows, masks)
        return StepResult(out.token_ids, out.logprobs, prompt_logprobs, speculated)

    def _burst(self, plan: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        """A burst plan's decode steps in one native call (`FusedDecode.burst`); where the
        fused step cannot run it (no native head, layer hooks wanted this step), one step."""
        fused = self.model.fused_decode
        hooked = self.model.layer_hooks_wanted is not None and self.model.layer_hooks_wanted()
        if fused is None or fused.embed is None or hooked:
            one = self.execute(replace(plan, num_steps=1), block_tables)
            return StepResult(one.sampled, one.logprobs, {}, bursts=[[t] for t in one.sampled])
        items, steps = plan.scheduled, plan.num_steps
        first = np.fromiter((it.request.num_computed_tokens for it in items), np.int64, len(items))
        tokens = [it.request.all_token_ids[n] for it, n in zip(items, first.tolist())]
        tables = [block_tables[it.request.request_id] for it in items]
        slots = self._slot_table(tables, int(first.max()) + steps)  # every position it computes
        bursts = fused.burst(tokens, first, slots, steps, self.kv_caches)
        return StepResult([b[0] for b in bursts], [None] * len(items), {}, bursts=bursts)

    def _draft(
        self, plan: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, torch.Tensor | None]:
        """The draft model's proposals for the step's speculating requests (in place of the
        scheduler's placeholders), and its distributions where verification needs them."""
        if self.drafter is None:
            return {}
        items = [s for s in plan.scheduled if s.spec_tokens]
        if not items:
            return {}
        rows = [self._sampling_row(s.request) for s in items]
        probs = self.drafter.propose(items, block_tables, rows)
        return {s.request.request_id: q for s, q in zip(items, probs)}

    def _verify(
        self,
        plan: SchedulerOutput,
        spec_rows: list[tuple[int, int, int]],
        hidden: torch.Tensor,
        draft_probs: dict[str, torch.Tensor | None],
    ) -> dict[str, Verdict]:
        """What each request with proposals emits, from the logits of all its positions (one
        logits product for all such requests), each position constrained as plain sampling
        would be with the proposals before it as output."""
        if not spec_rows:
            return {}
        index = torch.cat([torch.arange(a, b) for _, a, b in spec_rows]).to(hidden.device)
        logits = self.model.compute_logits(hidden[index])
        out, row = {}, 0
        for i, a, b in spec_rows:
            item = plan.scheduled[i]
            req, proposals = item.request, item.spec_tokens
            base = self._sampling_row(req)
            outputs = list(req.output_token_ids)
            rows = [SamplingRow(base.params, base.generator, req.prompt_token_ids,
                                outputs + proposals[:j]) for j in range(b - a)]  # fmt: skip
            masks = None
            if req.grammar_state is not None:
                bitmask = torch.empty(b - a, (self.config.vocab_size + 31) // 32, dtype=torch.int32)
                fill_proposal_bitmask(req.grammar_state, outputs, proposals, bitmask)
                masks = TokenMasks(list(range(b - a)), bitmask)
            out[req.request_id] = verify(self.sampler, logits[row : row + b - a], proposals,
                                         rows, masks, draft_probs.get(req.request_id))  # fmt: skip
            row += b - a
        return out

    def _grammar_masks(self, plan: SchedulerOutput) -> TokenMasks | None:
        """The allowed-token bitmask of each sampling row whose request has a grammar."""
        sampling = [s.request for s in plan.scheduled if s.sample and not s.spec_tokens]
        constrained = [(i, r) for i, r in enumerate(sampling) if r.grammar_state is not None]
        if not constrained:
            return None
        bitmask = torch.empty(
            len(constrained), (self.config.vocab_size + 31) // 32, dtype=torch.int32
        )
        fill_bitmask([(r.grammar_state, r.output_token_ids) for _, r in constrained], bitmask)
        return TokenMasks([i for i, _ in constrained], bitmask)

    def _prompt_logprobs(
        self, plan: SchedulerOutput, hidden: torch.Tensor, first_rows: list[int]
    ) -> dict[str, tuple[int, list[Logprob]]]:
        """Logprobs of the prompt tokens this step's chunks predict (position p scores token
        p + 1), for the requests that asked for them."""
        out: dict[str, tuple[int, list[Logprob]]] = {}
        for item, row in zip(plan.scheduled, first_rows):
            req, start = item.request, item.request.num_computed_tokens
            k = req.sampling_params.prompt_logprobs
            last = min(start + item.num_new_tokens, req.num_prompt_tokens - 1)
            if k is not None and last > start:
                targets = req.prompt_token_ids[start + 1 : last + 1]
                scored = self._score(hidden[row : row + last - start], targets, k)
                out[req.request_id] = (start + 1, scored)
        return out

    def _score(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[Logprob]:
        """Logprob of each target token under the logits of its row, with the top `k`."""
        scored: list[Logprob] = []
        for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            b = min(a + PROMPT_LOGPROB_ROWS, len(targets))
            logprobs = self.model.compute_logits(hidden[a:b]).float().log_softmax(dim=-1)
            index = torch.tensor(targets[a:b], device=logprobs.device).unsqueeze(-1)
            chosen = logprobs.gather(-1, index)  # [rows, 1]
            ranks = (logprobs > chosen).sum(dim=-1) + 1
            top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            for t, lp, rank, vs, ids in zip(
                targets[a:b],
                chosen.squeeze(-1).tolist(),
                ranks.tolist(),
                top_values.tolist(),
                top_ids.tolist(),
            ):
                scored.append(Logprob(t, lp, list(zip(ids, vs)), rank))
        return scored
