"""Many LoRA adapters in one step: adapter slots on the device (least recently used evicted, every adapter kept on the
host after its one read from disk), each step's rows grouped by slot, and each projection's low-rank update added on
top of its base output (Punica's segmented products: x @ A, then @ B, per group of rows sharing an adapter)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sluice.worker.engine.config import ModelError
from sluice.worker.engine.linear import Linear
from sluice.worker.engine.lora import TARGETS, LoRAAdapter, LoRAModule, LoRARequest, load_adapter


@dataclass
class Segments:
    """Rows with an adapter, grouped by slot: group g is order[starts[g]:starts[g + 1]], all using slots[g]. Built on
    the host from the scheduler's lists, so no step waits on the device to learn its groups."""

    order: torch.Tensor  # [rows with an adapter] int64
    starts: torch.Tensor  # [groups + 1] int32
    slots: torch.Tensor  # [groups] int32
    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows) for the grouped PyTorch path
    longest: int  # rows in the largest group: the Triton kernels' grid

    @classmethod
    def of(cls, slots: list[int], device: torch.device) -> Segments:
        """From each row's slot (-1: no adapter)."""
        order = sorted((i for i, s in enumerate(slots) if s >= 0), key=slots.__getitem__)  # stable: rows stay in order
        ids, bounds = [], [0]
        for i, row in enumerate(order):
            if not ids or slots[row] != ids[-1]:
                if ids:
                    bounds.append(i)
                ids.append(slots[row])
        bounds.append(len(order))
        if not ids:
            bounds = [0]
        order_t = torch.tensor(order, dtype=torch.int64, device=device)
        groups = [(s, order_t[bounds[g]:bounds[g + 1]]) for g, s in enumerate(ids)]
        return cls(order_t, torch.tensor(bounds, dtype=torch.int32, device=device),
                   torch.tensor(ids, dtype=torch.int32, device=device), groups,
                   max((b - a for a, b in zip(bounds, bounds[1:])), default=0))


@dataclass
class LoRAMapping:
    """One step's rows -> adapter slots. The model runs the last layer's o_proj and MLP on the sampled rows only,
    so a projection finds its rows' segments by its input's row count: every row, or the kept ones."""

    slots: list[int]  # per step row, -1 for the base model
    keep: list[int] | None  # the sampled rows, when the model narrows to them
    device: torch.device
    full: Segments = field(init=False)
    _kept: Segments | None = None

    def __post_init__(self) -> None:
        self.full = Segments.of(self.slots, self.device)

    def for_rows(self, rows: int) -> Segments:
        if rows == len(self.slots):
            return self.full
        if self.keep is not None and rows == len(self.keep):
            if self._kept is None:
                self._kept = Segments.of([self.slots[i] for i in self.keep], self.device)
            return self._kept
        raise RuntimeError(f"a LoRA projection got {rows} rows in a step of {len(self.slots)} "
                           f"({'none' if self.keep is None else len(self.keep)} sampled)")


class LoRALayer:
    """The adapters' updates of one Linear: per slot, its LoRAModule (None where that adapter leaves it alone), and
    for the Triton kernels the same zero-padded into stacks [slots, max rank, in] and [slots, out, max rank]."""

    def __init__(self, linear: Linear, manager: LoRAManager):
        self.manager = manager
        self.slots: list[LoRAModule | None] = [None] * manager.max_loras
        self.stack_a: torch.Tensor | None = None
        self.stack_b: torch.Tensor | None = None
        self.width = manager.max_rank * len(linear.out_sizes)  # every shard may carry up to max_rank
        self.linear = linear

    def load(self, slot: int, module: LoRAModule | None) -> None:
        self.slots[slot] = None if module is None else _to(module, self.manager.device)
        if not self.manager.use_triton or (self.stack_a is None and module is None):
            return
        if self.stack_a is None:  # the first adapter that updates this projection
            m, dev, dt = self.manager, self.manager.device, self.manager.dtype
            self.stack_a = torch.zeros(m.max_loras, self.width, self.linear.in_features, device=dev, dtype=dt)
            self.stack_b = torch.zeros(m.max_loras, self.linear.out_features, self.width, device=dev, dtype=dt)
        self.stack_a[slot].zero_()
        self.stack_b[slot].zero_()
        if module is not None:
            self.stack_a[slot, :module.rank] = self.slots[slot].a
            self.stack_b[slot, :, :module.rank] = self.slots[slot].b

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's adapter update, in place."""
        mapping = self.manager.mapping
        if mapping is None:  # no row of this step has an adapter
            return y
        seg = mapping.for_rows(x.shape[0])
        if not seg.groups:
            return y
        if self.stack_a is not None:
            from sluice.kernels.lora import lora_expand, lora_shrink

            t = lora_shrink(x, self.stack_a, seg.order, seg.starts, seg.slots, max_seg_len=seg.longest)
            lora_expand(t, self.stack_b, seg.order, seg.starts, seg.slots, y, max_seg_len=seg.longest)
            return y
        every_row = len(seg.groups) == 1 and seg.longest == x.shape[0]
        for slot, rows in seg.groups:  # one group per adapter in the step, never per row
            module = self.slots[slot]
            if module is None:
                continue
            if every_row:  # one adapter for the whole step: no gather or scatter
                y.addmm_(x @ module.a.T, module.b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ module.a.T) @ module.b.T)
        return y


def _to(module: LoRAModule, device: torch.device) -> LoRAModule:
    return LoRAModule(module.a.to(device), module.b.to(device))


class LoRAManager:
    """The engine's adapters: read once from disk and kept on the host, loaded into max_loras device slots on use,
    the least recently used evicted when a step needs a slot."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, use_triton: bool):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.dtype, self.device, self.use_triton = dtype, device, use_triton
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.mapping: LoRAMapping | None = None
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in TARGETS:
                module.lora = self.layers[name] = LoRALayer(module, self)

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names, read from disk on first use; the same name must keep the same directory."""
        known = self.adapters.get(request.lora_name)
        if known is not None:
            if known.path != Path(request.lora_path):
                raise ModelError(f"adapter {request.lora_name!r} is already loaded from {known.path}, not "
                                 f"{request.lora_path}")
            return known
        adapter = load_adapter(request.lora_name, request.lora_path, self.model, self.max_rank, self.dtype)
        self.adapters[request.lora_name] = adapter
        return adapter

    def begin_step(self, row_adapters: list[str | None], keep: list[int] | None) -> None:
        """Give every adapter of this step a slot and map the step's rows to them (no mapping: base rows only)."""
        names = set(row_adapters) - {None}
        if not names:
            self.mapping = None
            return
        slot = {name: self._slot(name, names) for name in names}
        self.mapping = LoRAMapping([-1 if a is None else slot[a] for a in row_adapters], keep, self.device)

    def end_step(self) -> None:
        self.mapping = None

    def _slot(self, name: str, step: set[str]) -> int:
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            return self.slot_of[name]
        if len(self.slot_of) < self.max_loras:
            slot = len(self.slot_of)
        else:  # the scheduler keeps a step's adapters within max_loras, so one not in this step is always found
            evicted = next(n for n in self.slot_of if n not in step)
            slot = self.slot_of.pop(evicted)
        adapter = self.adapters[name]
        for layer_name, layer in self.layers.items():
            layer.load(slot, adapter.modules.get(layer_name))
        self.slot_of[name] = slot
        return slot

