"""The public engine: `LLMEngine` (add_request / step / abort, for the worker) and `LLM` (generate / chat)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from sluice.worker.engine import detokenizer
from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.choices import Choices, choice_seed
from sluice.worker.engine.config import EngineConfig, ModelConfig
from sluice.worker.engine.grammar import Grammars, accept, fork_matcher
from sluice.worker.engine.lora import LoRARequest
from sluice.worker.engine.model_runner import ModelRunner
from sluice.worker.engine.outputs import RequestOutput
from sluice.worker.engine.processor import InputProcessor, Prompt, RequestRejected, load_tokenizer, max_model_len
from sluice.worker.engine.sampler import sample
from sluice.worker.engine.sampling_params import SamplingParams
from sluice.worker.engine.scheduler import Scheduler
from sluice.worker.engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from sluice.worker.engine.stats import StepStats


def resolve_model(model: str) -> Path:
    if model == "demo":
        from sluice.worker.engine.demo import demo_model_dir

        return demo_model_dir()
    return Path(model)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self.path = path = resolve_model(model)
        self.model_config = ModelConfig.from_dir(path)
        self.tokenizer = load_tokenizer(path)
        self.max_model_len = max_model_len(self.config, self.model_config)
        self.runner = ModelRunner(self.config, self.model_config, str(path), self.max_model_len)
        self.processor = InputProcessor(self.tokenizer, self.config, self.model_config, self.max_model_len,
                                        self.runner.num_blocks)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.eos_token_ids = self._eos_ids(path)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                                 self.config.max_num_seqs)
        self.token_text = detokenizer.TokenText.of(self.tokenizer)  # read for every generated token
        self.requests: dict[str, Sequence | Choices] = {}
        self.num_parents = 0  # n > 1 requests whose prompt is still prefilling: a step checks for forks only then
        self._ids = itertools.count()
        self.counters = dict.fromkeys(("num_steps", "num_prefill_tokens", "num_decode_tokens", "num_preemptions",
                                       "prefix_cache_queries", "prefix_cache_hits"), 0)
        self.busy_seconds = 0.0
        self.last_step: StepStats | None = None  # the last step's own counts; None: it had nothing to run

    def _eos_ids(self, path: Path) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
            ids.update([eos] if isinstance(eos, int) else eos or [])
        except OSError:
            pass
        return ids

    def encode(self, prompt: Prompt) -> list[int]:
        return self.processor.encode(prompt)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.processor.encode_chat(messages, tools)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one request; raises RequestRejected (naming the limit) if it could never run, ModelError if its
        adapter cannot be loaded."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        token_ids = self.encode(prompt)
        self.check(token_ids, params)
        lora = self.add_lora(lora_request) if lora_request is not None else None
        arrival_time = time.time() if arrival_time is None else arrival_time
        text = prompt if isinstance(prompt, str) else None
        if params.n > 1:
            self._add_choices(Choices(request_id, text, token_ids, params, arrival_time, priority, lora=lora))
            return request_id
        seq = self._new_sequence(request_id, token_ids, params, arrival_time, priority, text, params.seed)
        seq.lora = lora
        self.requests[request_id] = seq
        self._schedule(seq)
        return request_id

    def add_lora(self, request: LoRARequest) -> str:
        """Read an adapter (once: later requests naming it reuse it); returns its name. ModelError if it cannot
        serve on this base model."""
        if self.runner.lora is None:
            raise ValueError(f"adapter {request.lora_name!r} asked of an engine without LoRA: set enable_lora=True")
        return self.runner.lora.add(request).name

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float,
                      priority: int, prompt: str | None, seed: int | None) -> Sequence:
        seq = Sequence(request_id, token_ids, params, arrival_time, priority, prompt)
        if seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        if params.detokenize:
            detokenizer.start(self.tokenizer, seq, self.token_text)
        else:
            seq.text = None
        return seq

    def _add_choices(self, group: Choices) -> None:
        """Queue an n > 1 request: a parent that prefills the prompt's full blocks, or, with none to share, the
        choices themselves. The parent stops short of the prompt's last token, which each choice computes."""
        self.requests[group.request_id] = group
        shared = (len(group.prompt_token_ids) - 1) // self.block_manager.block_size * self.block_manager.block_size
        if shared:
            group.parent = Sequence(group.request_id, group.prompt_token_ids[:shared], group.params,
                                    group.arrival_time, group.priority, group=group, lora=group.lora)
            self.num_parents += 1
            self._schedule(group.parent)  # with a grammar, the choices fork from the parent's compiled one
            return
        self._new_choices(group)
        for seq in group.choices:
            self._schedule(seq)

    def _schedule(self, seq: Sequence) -> None:
        if seq.params.structured_outputs is not None:
            self.grammars.add(seq)  # scheduled once its grammar has compiled (_admit_grammars)
        else:
            self.scheduler.add(seq)

    def _new_choices(self, group: Choices) -> None:
        for i in range(group.params.n):
            seq = self._new_sequence(group.request_id, group.prompt_token_ids, group.params, group.arrival_time,
                                     group.priority, group.prompt, choice_seed(group.params.seed, i))
            seq.group, seq.lora = group, group.lora
            group.choices.append(seq)

    def _fork(self, parent: Sequence) -> None:
        """The parent has prefilled its blocks: hand them to every choice by reference and retire the parent."""
        group = parent.group
        self._new_choices(group)
        for seq in group.choices:
            self.block_manager.share(parent, seq)
            if parent.matcher is not None:
                seq.matcher = fork_matcher(parent)
            seq.num_computed_tokens = parent.num_computed_tokens
            seq.first_scheduled_time = parent.first_scheduled_time
            self.scheduler.add(seq)  # admitted under max_num_seqs like any request, keeping its blocks
        group.take_parent()
        self.num_parents -= 1
        self.scheduler.finish(parent)

    def check(self, token_ids: list[int], params: SamplingParams) -> None:
        self.processor.check(token_ids, params)

    @property
    def max_request_tokens(self) -> int:
        return self.processor.max_request_tokens

    def prompt_logits(self, prompt: Prompt, lora_request: LoRARequest | None = None) -> torch.Tensor:
        """Logits [len(prompt), vocab] (float32) at every prompt position: scoring and quality checks.

        Call it between steps: it borrows blocks from the cache and gives them back.
        """
        token_ids = self.encode(prompt)
        self.check(token_ids, SamplingParams(max_tokens=1))
        seq = Sequence("prompt-logits", token_ids, SamplingParams(), time.time())
        seq.lora = self.add_lora(lora_request) if lora_request is not None else None
        if not self.block_manager.can_allocate(seq, len(token_ids)):
            raise RequestRejected("not enough free KV blocks right now; call prompt_logits between batches")
        self.block_manager.allocate(seq, len(token_ids))
        try:
            return self.runner.all_logits(seq)
        finally:
            self.block_manager.free(seq)

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if isinstance(request, Choices):
            self.num_parents -= request.parent is not None
        for seq in request.sequences() if isinstance(request, Choices) else [request]:
            seq.finish_reason = "abort"
            if not self.grammars.discard(seq):
                self.scheduler.finish(seq)
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's name); False, and nothing dropped, while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.grammars.num_waiting > 0

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that gained a token (finished or not), or only
        for those that finished (a caller that streams nothing: the worker's engine process)."""
        start = time.perf_counter()
        failed = self._admit_grammars()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            self.last_step = None  # nothing ran: no stats for the caller to count again
            return failed
        scheduled_at = time.time()  # a request's queue time ends here, not once its first step has run
        logits, sample_seqs = self.runner.run(plan.scheduled)
        parents: list[Sequence] = []
        if self.num_parents:
            logits, sample_seqs, parents = _without_parents(logits, sample_seqs)
        self.grammars.mask(logits, sample_seqs)
        tokens, logprobs = sample(logits, sample_seqs, self.eos_token_ids) if sample_seqs else ([], [])
        now = time.time()
        decode_tokens = 0
        for seq, n in plan.scheduled:
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decode_tokens += 1
            seq.num_computed_tokens += n
            seq.first_scheduled_time = seq.first_scheduled_time or scheduled_at
            self.block_manager.commit_full_blocks(seq)
        for seq, token, lp in zip(sample_seqs, tokens, logprobs):
            self._append(seq, token, lp, now)
        elapsed = time.perf_counter() - start
        total = plan.num_tokens
        for seq, n in plan.scheduled:
            seq.gpu_seconds += elapsed * n / total
        for parent in parents:  # after its share of this step is counted
            self._fork(parent)
        self.last_step = StepStats(elapsed, len(plan.scheduled), total, len(sample_seqs), total - decode_tokens,
                                   decode_tokens, len(plan.preempted), plan.prefix_queries, plan.prefix_hits,
                                   self.block_manager.num_used_blocks)
        self._count(self.last_step)
        return failed + self._outputs(sample_seqs, finished_only)

    def _outputs(self, sample_seqs: list[Sequence], finished_only: bool) -> list[RequestOutput]:
        """One output per request that sampled (an n > 1 request once, with all its choices); finished ones leave."""
        outputs = []
        for request in dict.fromkeys(seq.group or seq for seq in sample_seqs):
            finished = request.is_finished
            if finished or not finished_only:
                outputs.append(RequestOutput.from_choices(request) if isinstance(request, Choices)
                               else RequestOutput.from_seq(request))
            if finished:
                del self.requests[request.request_id]
        return outputs

    def _admit_grammars(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar has compiled; finish, with an error, those whose grammar failed."""
        if not self.grammars.num_waiting:
            return []
        ready, failed = self.grammars.poll(idle=not self.scheduler.has_work())
        for seq in ready:
            self.scheduler.add(seq)
        now = time.time()
        outputs = []
        for seq, error in failed:
            seq.status = SequenceStatus.FINISHED
            request = self.requests.pop(seq.request_id, None)
            if request is None:  # another choice of the same request failed first
                continue
            if isinstance(request, Choices):
                self._fail_choices(request, seq)
            outputs.append(RequestOutput.rejected(seq.request_id, request.prompt, request.prompt_token_ids, error,
                                                  now))
        return outputs

    def _fail_choices(self, group: Choices, failed: Sequence) -> None:
        """An n > 1 request whose grammar failed: every other sequence of it leaves too."""
        self.num_parents -= group.parent is not None
        for seq in group.sequences():
            if seq is not failed and not self.grammars.discard(seq):
                self.scheduler.finish(seq)

    def _count(self, step: StepStats) -> None:
        """Add a step to the running totals that stats() reports."""
        c = self.counters
        c["num_steps"] += 1
        c["num_prefill_tokens"] += step.num_prefill_tokens
        c["num_decode_tokens"] += step.num_decode_tokens
        c["num_preemptions"] += step.num_preemptions
        c["prefix_cache_queries"] += step.prefix_cache_queries
        c["prefix_cache_hits"] += step.prefix_cache_hits
        self.busy_seconds += step.seconds

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float) -> None:
        seq.token_ids.append(token)
        seq.first_token_time = seq.first_token_time or now
        if lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        new = ""
        if p.detokenize:
            new = detokenizer.append(self.token_text, seq, token)
            seq.text += new
        reason = None
        generated = len(seq.token_ids) - seq.num_prompt_tokens
        completed = seq.matcher is not None and accept(seq, token)  # the grammar ends with an eos token
        if completed or (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
            if new:  # the stop token's own text is not output (as vLLM)
                seq.text = seq.text[:-len(new)]
        elif p.stop and generated >= p.min_tokens and self._truncate_at_stop(seq, len(new)):  # as vLLM
            reason = "stop"
        elif generated >= p.max_tokens:
            reason = "length"
        if reason:
            seq.finish_reason, seq.finish_time = reason, now
            self.scheduler.finish(seq)

    @staticmethod
    def _truncate_at_stop(seq: Sequence, new: int) -> bool:
        # cut at the earliest match of any stop string, not the first in list order: one token can complete two,
        # and the text must keep neither (OpenAI's semantics). Only a match ending in the new `new` characters is
        # new (an earlier one finished the request), so the search starts there: not the whole text every token
        start = max(len(seq.text) - new - max(map(len, seq.params.stop)) + 1, 0)
        found = [at for stop in seq.params.stop if (at := seq.text.find(stop, start)) != -1]
        if found:
            seq.text = seq.text[:min(found)]
        return bool(found)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            **self.counters,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "block_size": bm.block_size,
            "weight_bytes": self.runner.weight_bytes,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "kv_cache_dtype": "int8" if self.runner.kv_int8 else str(self.runner.dtype).removeprefix("torch."),
            "kv_cache_tokens": bm.num_blocks * bm.block_size,
            "quantization": self.runner.quantization,  # "int4", or a checkpoint's own: "gptq-int4"
            "busy_seconds": self.busy_seconds,
        }


def _without_parents(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence],
                                                                         list[Sequence]]:
    """Split off the n > 1 parents that finished prefilling: they fork instead of sampling."""
    parents = [seq for seq in seqs if seq.group is not None and seq is seq.group.parent]
    if not parents:
        return logits, seqs, []
    keep = [i for i, seq in enumerate(seqs) if seq.group is None or seq is not seq.group.parent]
    return logits[keep], [seqs[i] for i in keep], parents


class LLM(LLMEngine):
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs come back in input order. `lora_request`:
        one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run_all(list(prompts), sampling_params, lora_request)

    def chat(self, conversations: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the chat template to each conversation (a list of {"role", "content"}), with `tools` (OpenAI's
        function definitions) rendered as the template renders them, and generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run_all([self.encode_chat(c, tools) for c in conversations], sampling_params)

    def _run_all(self, prompts: list[Prompt], sampling_params, lora_request=None) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        loras = lora_request if isinstance(lora_request, Seq) else [lora_request] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params and {len(loras)} "
                             f"lora requests")
        ids, done = [], {}
        for prompt, p, lora in zip(prompts, params, loras):
            request_id = f"gen-{next(self._ids)}"
            ids.append(request_id)
            try:
                self.add_request(prompt, p, request_id, lora_request=lora)
            except RequestRejected as e:
                done[request_id] = RequestOutput.rejected(request_id, prompt, self.encode(prompt), str(e), time.time())
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
