"""Owns the model and the KV cache on the device: turns a step's schedule into one batched forward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache, cached_property

import torch

import sluice
from sluice.kernels import cpu_gemm as sluice_gemm
from sluice.kernels import cpu_layers
from sluice.worker.engine.attention import AttentionMetadata, LayerCache, TorchAttention
from sluice.worker.engine.config import CPU_DEFAULT_KV_CACHE_MEMORY, EngineConfig, ModelConfig
from sluice.worker.engine.linear import (
    DENSE,
    ONEDNN_FLOAT32,
    PACKED_FLOAT32,
    Linear,
    PackedOneDnnFloat32,
    PackedSluiceGemm,
    can_pack_float32,
    can_pack_half,
    cpu_gemm,
    native_half_gemm,
)
from sluice.worker.engine.loader import build_model, init_dummy_weights, load_weights, materialize
from sluice.worker.engine.lora_layers import LoRAManager
from sluice.worker.engine.memory import activation_bytes, kv_bytes_per_token, kv_cache_budget
from sluice.worker.engine.prequantized import checkpoint_quantization
from sluice.worker.engine.quantization import new_method, quantize_model, quantized_linears
from sluice.worker.engine.sequence import Sequence

log = logging.getLogger(__name__)


@cache  # once a process, not once an engine
def _warn_default_spin() -> None:
    log.warning("torch was imported before sluice, so OpenMP kept its default spin (GOMP_SPINCOUNT=300000): on a host "
                "whose other processes also use these CPUs the engine may run several times slower; import sluice "
                "first or set GOMP_SPINCOUNT=%s", sluice.OPENMP_SPIN_DEFAULT)


@dataclass
class PreparedBatch:
    """One step's flat batch: every scheduled token of every sequence, decode rows first, no padding."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attention: AttentionMetadata  # slot_mapping [num_tokens], block_tables [num_seqs, max_blocks], ...
    logits_rows: torch.Tensor  # [num_sampled] int64: the rows of the sequences' last tokens, the ones sampled
    sample_seqs: list[Sequence]  # [num_sampled]: the sequences those rows sample for, in their order
    row_adapters: list[str | None] | None = None  # each row's LoRA adapter (None: the base model), when serving LoRA
    sampled_rows: list[int] | None = None  # logits_rows on the host, when serving LoRA


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str, max_model_len: int):
        self.config, self.model_config = config, model_config
        self.device = config.torch_device()
        if self.device.index is not None and self.device.type == "cuda":
            # Triton launches on the current device, not on its tensors': with cuda:0 current, kernels given cuda:1
            # tensors fail ("Pointer argument cannot be accessed from Triton"). Per thread: the engine's one thread
            # both builds and steps it
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype(model_config)
        if self.device.type == "cpu" and sluice.OPENMP_SPIN is None:
            _warn_default_spin()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.kv_int8 = config.kv_cache_dtype == "int8"
        self.backend = self._attention_backend()
        cpu_layers.takes(self.device, self.dtype)  # builds the kernels now (once per machine), not in the first step
        self.model = build_model(model_config, self.backend, max_model_len, self.dtype, self.device)
        self.quantization = self._load_weights(path)
        if config.quantization:  # what loading left in float: dummy weights, weights outside the projections
            quantize_model(self.model, config.quantization, config.quantization_group_size,
                           config.backend("linear_backend"), config.quantize_lm_head)
        if config.backend("linear_backend") == "torch":
            self._pack_cpu_weights()
        self.lora = None
        if config.enable_lora:  # after packing: the adapters' updates ride on whatever form the base weights took
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device,
                                    use_triton=config.backend("linear_backend") == "triton")
        self.num_blocks = self._num_kv_blocks()
        self.caches = [self._layer_cache() for _ in range(model_config.num_layers)]

    def _load_weights(self, path: str) -> str | None:
        """Load (or, for load_format 'dummy', draw) the weights; returns the quantization they are held in."""
        config, linear_backend = self.config, self.config.backend("linear_backend")
        if config.load_format == "dummy":
            materialize(self.model, self.device)
            init_dummy_weights(self.model)
            return config.quantization
        prequantized = checkpoint_quantization(self.model_config.raw)
        if prequantized is not None and config.quantization:
            raise ValueError(f"quantization={config.quantization!r} quantizes a float checkpoint; {path} is "
                             f"already quantized ({prequantized.label}): leave quantization unset")
        on_load = set()
        if config.quantization:
            on_load = set(quantized_linears(self.model, config.quantization, config.quantization_group_size,
                                            config.quantize_lm_head))

        def quantize(layer: Linear):
            if layer in on_load:
                return new_method(config.quantization, config.quantization_group_size, linear_backend)
            return None

        load_weights(self.model, path, self.device, quantize, prequantized, linear_backend)
        return prequantized.label if prequantized is not None else config.quantization

    def _attention_backend(self):
        if self.config.backend("attention_backend") == "torch":
            backend = TorchAttention()
            backend.prepare(self.device, self.dtype)
            return backend
        from sluice.worker.engine.triton_attention import TritonAttention

        return TritonAttention()

    def _layer_cache(self) -> LayerCache:
        shape = (self.num_blocks, self.block_size, self.model_config.num_kv_heads, self.model_config.head_dim)
        if not self.kv_int8:
            return LayerCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                              torch.zeros(shape, dtype=self.dtype, device=self.device))
        k, v = (torch.zeros(shape, dtype=torch.int8, device=self.device) for _ in range(2))
        k_scale, v_scale = (torch.ones(shape[:3], dtype=torch.float32, device=self.device) for _ in range(2))
        return LayerCache(k, v, k_scale, v_scale)

    def _pack_cpu_weights(self) -> None:
        """CPU projections go to the packed layout of the GEMM linear.cpu_gemm picks for the dtype (bfloat16 and
        float16 only where the CPU multiplies them natively); a tied lm_head keeps the embedding's tensor (packing
        would copy it) and only switches to oneDNN's GEMM, which multiplies an unpacked weight faster than MKL on
        Intel and AMD CPUs alike."""
        if self.device.type != "cpu":
            return
        if self.dtype in (torch.bfloat16, torch.float16) and not native_half_gemm(self.dtype):
            log.warning("this CPU has no native %s arithmetic (AVX512-BF16, AMX): its matmuls convert to float32 "
                        "tile by tile, and --dtype float32 is likely faster", str(self.dtype).removeprefix("torch."))
        gemm = cpu_gemm(self.config.cpu_gemm, self.dtype)
        for module in self.model.modules():
            if not (isinstance(module, Linear) and module.method is DENSE):
                continue
            w = module.weight
            onednn = can_pack_float32(w) or can_pack_half(w)
            if w is self.model.model.embed_tokens.weight:
                module.method = ONEDNN_FLOAT32 if onednn else DENSE
            elif gemm == "sluice" and sluice_gemm.supports(w):
                module.method = PackedSluiceGemm(module)
            elif onednn:
                module.method = PACKED_FLOAT32.get(gemm, PackedOneDnnFloat32)(module)

    @cached_property  # fixed once loaded, and stats() is read after every step by the worker's metrics
    def weight_bytes(self) -> int:
        """Bytes the weights occupy (tied tensors once; the rotary table is not a weight)."""
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.model.state_dict().values()}
        packed = [m.method.nbytes for m in self.model.modules()
                  if isinstance(m, Linear) and isinstance(m.method, (*PACKED_FLOAT32.values(), PackedSluiceGemm))]
        return sum(tensors.values()) + sum(packed)

    @cached_property
    def kv_cache_bytes(self) -> int:
        tensors = [t for c in self.caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_per_block(self) -> int:
        """K and V of one block in every layer; an INT8 cache adds a float32 scale per token and head."""
        return self.block_size * kv_bytes_per_token(self.model_config, self.dtype, self.kv_int8)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            blocks = cfg.kv_cache_memory // self.bytes_per_block()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()  # what loading freed (quantization's float weights) is free, not PyTorch's cache
            free, _ = torch.cuda.mem_get_info(self.device)
            activations = activation_bytes(self.model_config, cfg.max_num_batched_tokens)
            blocks = kv_cache_budget(free, activations) // self.bytes_per_block()
        else:
            # no more than the engine could ever use: every sequence at full length
            most = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)
            blocks = min(CPU_DEFAULT_KV_CACHE_MEMORY // self.bytes_per_block(), most)
        if blocks < 1:
            raise ValueError(f"the KV cache budget holds no {self.block_size}-token block; give more memory")
        return int(blocks)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """One forward over every scheduled token; returns logits for sequences whose last token was computed."""
        batch = self.prepare(scheduled)
        hidden = self._forward(batch, batch.logits_rows, batch.sampled_rows)
        if not batch.sample_seqs:
            # nothing reads this step back, so wait for the device here: else its GPU time lands in the next step
            # (whose prepare syncs) and is charged to that step's sequences
            if hidden.is_cuda:
                torch.cuda.synchronize(hidden.device)
            return torch.empty(0), []
        return self.model.compute_logits(hidden), batch.sample_seqs

    @torch.inference_mode()
    def all_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits at every position of a sequence's uncomputed tokens (its blocks already allocated)."""
        batch = self.prepare([(seq, seq.num_remaining)])
        return self.model.compute_logits(self._forward(batch))

    def _forward(self, batch: PreparedBatch, keep: torch.Tensor | None = None,
                 sampled_rows: list[int] | None = None) -> torch.Tensor:
        """The model over the batch (its `keep` rows' outputs only, if given), each row with its LoRA adapter."""
        if self.lora is not None:
            self.lora.begin_step(batch.row_adapters, sampled_rows)
        try:
            return self.model(batch.input_ids, batch.positions, self.caches, batch.attention, keep=keep)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> PreparedBatch:
        """The step's tensors on the device, from each scheduled sequence and its number of new tokens."""
        # single-token rows first, sorted by context so the attention backend's decode buckets pad little
        scheduled = sorted(scheduled, key=lambda item: (item[1] != 1, item[0].num_computed_tokens))
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, logits_rows, sample_seqs = [], [], [], []
        row_adapters = [] if self.lora is not None else None
        for seq, n in scheduled:
            if row_adapters is not None:
                row_adapters += [seq.lora] * n
            start = seq.num_computed_tokens
            table = seq.block_table
            if n == 1:  # most rows of most steps: no slices or comprehensions to build
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:start + n]
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            context_lens.append(start + n)
            if start + n == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        width = max(len(seq.block_table) for seq, _ in scheduled)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in scheduled]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens=query_lens,
            context_lens_list=context_lens,
        )  # each layer's window is the model's to set (Decoder.forward)
        return PreparedBatch(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                             torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                             torch.tensor(logits_rows, dtype=torch.int64, device=dev), sample_seqs, row_adapters,
                             logits_rows if row_adapters is not None else None)
