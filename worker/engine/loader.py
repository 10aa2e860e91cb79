"""Loads a Hugging Face checkpoint directory's safetensors into an engine model, naming any bad file or tensor."""

from __future__ import annotations

import ctypes
import json
import platform
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from sluice.worker.engine.config import ModelConfig, ModelError
from sluice.worker.engine.linear import Linear, take_weight
from sluice.worker.engine.models import MODELS
from sluice.worker.engine.prequantized import Prequantized, Repacked
from sluice.worker.engine.quantization import Int4Method, Int8Method
from sluice.worker.engine.safetensors_stream import SafetensorsError, TensorInfo, tensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved
TIED_HEAD = "lm_head.weight"
# bytes of float rows quantized at a time while loading: quantizing a whole tensor made several float temporaries of
# its size; much smaller chunks paid PyTorch's per-op cost (a thread pool's wake-up) thousands of times
QUANTIZE_CHUNK = 1 << 20
QuantMethod = Int4Method | Int8Method


def build_model(config: ModelConfig, backend, max_positions: int, dtype: torch.dtype, device: torch.device):
    """The model with its parameters on the meta device, allocated one by one as their tensors load (load_weights):
    a projection quantized on load never exists in float beside the others. Buffers (the rotary tables) are computed
    on the device as usual."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # each parameter is allocated (untouched) before it goes to meta: mapped and unmapped, never a heap hole
        with torch.device(device), _meta_parameters(), freed_blocks_unmapped():
            return MODELS[config.architecture](config, backend, max_positions)
    finally:
        torch.set_default_dtype(default)


@contextmanager
def _meta_parameters():
    """Every parameter a module registers goes to the meta device (accelerate's init_empty_weights does the same). A
    parameter's initialisation then runs on meta, at no cost; its allocation (untouched) is freed at once."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{index}: unreadable index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelError(f"{index}: lists shard(s) not in the directory: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights found")
    return files


def load_weights(model: nn.Module, path: str | Path, device: torch.device | str = "cpu",
                 quantize: Callable[[Linear], QuantMethod | None] = lambda layer: None,
                 prequantized: Prequantized | None = None, backend: str = "torch") -> None:
    """Load every tensor the model expects from the checkpoint, one at a time; missing or misshapen ones are errors.

    Each is placed before the next is read: a float parameter is allocated on the device as its first tensor arrives,
    a projection that `quantize` gives a method is quantized shard by shard (q, k, v each on its own: the same bytes
    as the fused weight's), so are modules placing their own rows (MoE experts: load_rows) it gives one, tensor by
    tensor, and a pre-quantized projection is repacked once its tensors are in. Device memory peaks at the final
    weights plus one float tensor in flight; host memory at one tensor (safetensors_stream.py)."""
    path = Path(path)
    loading = _Loading(model, torch.device(device), quantize, prequantized, backend)
    with freed_blocks_unmapped():
        for file in safetensors_files(path):
            try:
                for info, read in tensors(file):
                    loading.take(info, read, file)
            except ModelError:
                raise
            except (OSError, SafetensorsError) as e:
                raise ModelError(f"{file}: unreadable safetensors file: {e}") from None
        loading.finish(path)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
LOAD_THRESHOLD = 128 << 10  # glibc's default for both
MAX_MMAP_THRESHOLD = 32 << 20  # the most glibc's dynamic threshold reaches (64-bit); trimming then starts at twice it


@contextmanager
def freed_blocks_unmapped():
    """Host blocks of 128 KiB and more mapped on their own while loading, so each is returned when freed.

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB): after the first tensor,
    every tensor read and every quantization temporary came from the heap, and the heap, fragmented by the weights
    kept between them, held on to them all (the bench model in INT4 ended with 4x its weights resident); the heap's
    free top is trimmed past 128 KiB too. Both are then set to where glibc's dynamic thresholds end up in a
    long-running process: 32 MiB, and twice that."""
    mallopt = _glibc_mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, LOAD_THRESHOLD)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, 2 * MAX_MMAP_THRESHOLD)


def _glibc_mallopt():
    if not platform.libc_ver()[0] == "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


@dataclass
class _Shards:
    """A quantized projection's shards (q/k/v, gate/up) until all are in: their buffers by first row."""

    method: QuantMethod
    total: int
    stored: bool  # quantized in the checkpoint (else here, from float shards)
    rows: dict[int, Repacked] = field(default_factory=dict)


class _Loading:
    def __init__(self, model: nn.Module, device: torch.device, quantize, prequantized: Prequantized | None,
                 backend: str):
        self.model, self.device, self.quantize, self.prequantized, self.backend = (model, device, quantize,
                                                                                    prequantized, backend)
        self.expected = model.checkpoint_tensors()
        self.owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied parameter has two
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    self.owners.setdefault(id(param), []).append((module, attr))
        # projections by weight; a tied lm_head's is the embedding's, loaded as that (quantize_model copies it later)
        self.linear = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)
                       and isinstance(getattr(m, "weight", None), torch.Tensor) and len(self.owners[id(m.weight)]) == 1}
        # modules that place their own rows (MoE experts) by their parameters, and the method each is quantized with
        self.row_takers = {id(p): m for m in model.modules() if callable(getattr(m, "load_rows", None))
                           for p in m._parameters.values() if p is not None}
        self.row_methods: dict[nn.Module, QuantMethod | None] = {}
        self.num_shards = Counter(id(param) for param, _ in self.expected.values())
        self.placed: dict[int, nn.Parameter] = {}  # meta parameter -> its tensor on the device
        self.pending: dict[Linear, _Shards] = {}
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # a pre-quantized projection's tensors so far
        self.loaded: set[str] = set()
        self.head: torch.Tensor | None = None  # a tied model's stored lm_head.weight, compared once all is in
        self.num_prequantized = 0

    def take(self, info: TensorInfo, read, file: Path) -> None:
        name = info.name
        prefix, _, suffix = name.rpartition(".")
        pre = self.prequantized
        if pre is not None and pre.takes(suffix, info.dtype) and f"{prefix}.weight" in self.expected:
            self._part(prefix, suffix, read(), file)
        elif name == TIED_HEAD and name not in self.expected and self.model.config.tie_word_embeddings:
            self.head = read()
        elif name in self.expected:
            self._tensor(name, read(), file)
        elif not name.endswith(IGNORED_SUFFIXES):
            # a tensor the model has no place for is a weight it would compute without
            raise ModelError(f"{file.name}: unexpected tensor {name} (not used by "
                             f"{self.model.config.architecture} with this config.json)")

    def _tensor(self, name: str, tensor: torch.Tensor, file: Path) -> None:
        param, rows = self.expected[name]
        target_shape = tuple(param.shape if rows is None else param[rows].shape)
        if tuple(tensor.shape) != target_shape:
            raise ModelError(f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{target_shape}")
        if self._rows_taken(name, param, rows, tensor):
            return
        layer = self.linear.get(id(param))
        if layer in self.pending and self.pending[layer].stored:
            raise ModelError(f"{file.name}: tensor {name} is float, the projections fused with it are "
                             f"{self.prequantized.label}")
        method = self.quantize(layer) if layer is not None and layer not in self.pending else None
        if layer in self.pending or method is not None:
            w = tensor.to(self.device, param.dtype)
            del tensor
            shards = self.pending.setdefault(layer, _Shards(method, self.num_shards[id(param)], stored=False))
            self._shard(layer, rows, Repacked(_quantize_in_chunks(shards.method, w), None), name)
        else:
            dest = self._place(param)
            (dest.data if rows is None else dest.data[rows]).copy_(tensor)
        self.loaded.add(name)

    def _rows_taken(self, name: str, param: nn.Parameter, rows: slice, tensor: torch.Tensor) -> bool:
        """Quantize the tensor into its module's rows if that module takes its own and `quantize` gives it a method
        (its quantized buffers allocated at its first tensor); False where it loads as a float parameter."""
        module = self.row_takers.get(id(param))
        if module is None:
            return False
        if module not in self.row_methods:
            self.row_methods[module] = method = self.quantize(module)
            if method is not None:
                mode, group_size = ("int8", 0) if isinstance(method, Int8Method) else ("int4", method.group_size)
                module.quantize_on_load(mode, group_size, method.backend, self.device)
        method = self.row_methods[module]
        if method is None:
            return False
        w = tensor.to(self.device, param.dtype)
        del tensor
        module.load_rows(self.owners[id(param)][0][1], rows, _quantize_in_chunks(method, w))
        self.loaded.add(name)
        return True

    def _part(self, prefix: str, suffix: str, tensor: torch.Tensor, file: Path) -> None:
        pre = self.prequantized
        parts = self.parts.setdefault(prefix, {})
        parts[suffix] = tensor.to(self.device)
        if not pre.complete(parts):
            return
        del self.parts[prefix]
        name = f"{prefix}.weight"
        param, rows = self.expected[name]
        layer = self.linear.get(id(param))
        if layer is None or id(param) in self.placed:
            raise ModelError(f"{file.name}: tensor {prefix}.{suffix} is {pre.label}, but {name} is not a projection "
                             f"stored that way" + (" (its other shards are float)" if layer is not None else ""))
        n = param.shape[0] if rows is None else rows.stop - rows.start
        repacked = pre.repack(parts, n, layer.in_features, param.dtype, prefix)
        if layer not in self.pending:
            method = Int8Method(self.backend) if repacked.group_size is None else Int4Method(self.backend,
                                                                                          repacked.group_size)
            self.pending[layer] = _Shards(method, self.num_shards[id(param)], stored=True)
        self._shard(layer, rows, repacked, name)
        self.loaded.add(name)
        self.num_prequantized += 1

    def _shard(self, layer: Linear, rows: slice | None, repacked: Repacked, name: str) -> None:
        shards = self.pending[layer]
        first = next(iter(shards.rows.values()), repacked)
        if repacked.group_size != first.group_size or not _same(repacked.perm, first.perm):
            raise ModelError(f"tensor {name}: its quantization (group size, act-order) differs from the other "
                             f"projections fused with it")
        shards.rows[0 if rows is None else rows.start] = repacked
        if len(shards.rows) < shards.total:
            return
        del self.pending[layer]
        ordered = [shards.rows.pop(start) for start in sorted(shards.rows)]
        buffers = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(r.buffers for r in ordered))]
        del ordered
        take_weight(layer)  # the meta placeholder
        shards.method.load(layer, *buffers, **({} if first.perm is None else {"perm": first.perm}))
        layer.method = shards.method

    def _place(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter on the device, allocated when its first tensor arrives (empty until copied into)."""
        if id(param) not in self.placed:
            real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=self.device), requires_grad=False)
            for module, attr in self.owners[id(param)]:
                module._parameters[attr] = real
            self.placed[id(param)] = real
        return self.placed[id(param)]

    def finish(self, path: Path) -> None:
        missing = sorted(set(self.expected) - self.loaded - {f"{prefix}.weight" for prefix in self.parts})
        for prefix, parts in self.parts.items():  # a partly stored projection: name the parts it lacks
            missing += [f"{prefix}.{p}" for p in self.prequantized.parts if p not in parts]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelError(f"{path}: checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")
        if self.prequantized is not None and not self.num_prequantized:
            raise ModelError(f"{path}: config.json says {self.prequantized.label}, but no projection is stored "
                             f"quantized")
        unloaded = [name for name, p in self.model.named_parameters() if p.device.type == "meta"]
        if unloaded:
            raise RuntimeError(f"parameters no checkpoint tensor loads (checkpoint_tensors): {', '.join(unloaded)}")
        if self.head is not None:
            _untie_if_different(self.model, self.head)


def _quantize_in_chunks(method: QuantMethod, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """method.quantize_rows over QUANTIZE_CHUNK bytes of rows at a time: rows quantize on their own (the same bytes),
    and the float temporaries of quantizing stay that small instead of several times the tensor."""
    rows = max(1, QUANTIZE_CHUNK // (w.shape[1] * w.element_size()))
    chunks = [method.quantize_rows(w[i:i + rows]) for i in range(0, w.shape[0], rows)]
    return chunks[0] if len(chunks) == 1 else tuple(torch.cat(parts) for parts in zip(*chunks))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate every parameter still on the meta device (uninitialised): for weights that are not loaded."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None and param.device.type == "meta":
                owners.setdefault(id(param), []).append((module, attr))
    for entries in owners.values():
        module, attr = entries[0]
        param = module._parameters[attr]
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
        for module, attr in entries:
            module._parameters[attr] = real


def _untie_if_different(model: torch.nn.Module, head: torch.Tensor) -> None:
    """transformers uses a tied checkpoint's stored lm_head.weight when it differs from the embeddings: so do we."""
    embed = model.model.embed_tokens.weight
    if head.shape != embed.shape:
        raise ModelError(f"tensor {TIED_HEAD} has shape {tuple(head.shape)}, the config implies {tuple(embed.shape)}")
    head = head.to(embed.dtype)
    if not torch.equal(head, embed.detach().cpu()):
        model.lm_head.weight = torch.nn.Parameter(head.to(embed.device), requires_grad=False)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place of a checkpoint (vLLM's load_format="dummy"): benchmarks need only config.json."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
