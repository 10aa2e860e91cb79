"""Owns the model and the KV cache on the device: turns a step's schedule into one batched forward."""

from __future__ import annotations

import torch

from worker.engine.attention import AttentionMetadata, LayerCache, TorchAttention
from worker.engine.config import CPU_DEFAULT_KV_CACHE_MEMORY, CUDA_MEMORY_FRACTION, EngineConfig, ModelConfig
from worker.engine.loader import build_model, load_weights
from worker.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str, max_model_len: int):
        self.config, self.model_config = config, model_config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = TorchAttention()
        self.model = build_model(model_config, self.backend, max_model_len, self.dtype, self.device)
        load_weights(self.model, path)
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.caches = [
            LayerCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_layers)
        ]

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy (tied tensors once; the rotary table is not a weight)."""
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.model.state_dict().values()}
        return sum(tensors.values())

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in self.caches)

    def bytes_per_block(self) -> int:
        c = self.model_config
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            blocks = cfg.kv_cache_memory // self.bytes_per_block()
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            activations = cfg.max_num_batched_tokens * (self.model_config.intermediate_size * 2
                                                         + self.model_config.vocab_size) * 4
            blocks = int((free - activations) * CUDA_MEMORY_FRACTION) // self.bytes_per_block()
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
        input_ids, positions, meta, logits_rows, sample_seqs = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.caches, meta)
        if not sample_seqs:
            return torch.empty(0), []
        return self.model.compute_logits(hidden[logits_rows]), sample_seqs

    def _prepare(self, scheduled: list[tuple[Sequence, int]]):
        # single-token rows first, sorted by context so the attention backend's decode buckets pad little
        scheduled = sorted(scheduled, key=lambda item: (item[1] != 1, item[0].num_computed_tokens))
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, logits_rows, sample_seqs = [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            table = seq.block_table
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
            sliding_window=self.model_config.sliding_window,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=dev)
        return ids, pos, meta, rows, sample_seqs
