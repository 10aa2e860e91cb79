"""Pre-quantized checkpoints: GPTQ, AWQ and compressed-tensors weight-only INT4/INT8, repacked as they load.

config.json's quantization_config says how each projection is stored. `checkpoint_quantization` reads it and refuses,
naming it, whatever the engine cannot compute exactly; `Prequantized.repack` turns one projection's tensors into the
formats of kernels/quant.py, which the INT4/INT8 methods of quantization.py run on CPU and CUDA:

- INT4 is w = (q - 8) * scale + zero in groups of 32, 64 or 128 along K. A checkpoint's w = scale * (q - z) is that
  with zero = scale * (8 - z) (symmetric GPTQ: z = 8, zero = 0); a coarser group (256, or a whole row per channel)
  repeats its scale and zero over groups of 128 (or 64, 32: the largest dividing both).
- GPTQ's act-order (desc_act) puts column k in group g_idx[k], groups not contiguous. Sorting the columns by group
  makes them so; the layer then gathers x's features into the same order before each matmul, as vLLM's GPTQ does.
- INT8 is symmetric per output channel (q * scale): compressed-tensors' W8A16 with strategy "channel".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.kernels.quant import INT4_GROUP_SIZES, pack_int4
from sluice.worker.engine.config import ModelError

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's GEMM packing: column 8j + m sits in nibble REVERSE[m]
INT8_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class Repacked:
    """One projection's weight in sluice's format: (qweight, scales, zeros) for INT4, (qweight, scale) for INT8."""

    buffers: tuple[torch.Tensor, ...]
    group_size: int | None  # INT4's group; None for INT8
    perm: torch.Tensor | None = None  # act-order: x's features in the order of the weight's columns


@dataclass(frozen=True)
class Prequantized:
    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int  # 4 or 8
    group_size: int  # -1: one group per output row (per channel)
    parts: tuple[str, ...]  # the tensors each quantized projection stores, by name suffix
    act_order: bool = False  # a g_idx tensor gives each column's group
    zero_offset: int = 0  # GPTQ's original (v1) format stores z - 1
    symmetric: bool = True

    @property
    def label(self) -> str:
        return f"{self.method}-int{self.bits}"

    @property
    def g_idx(self) -> str:
        return "weight_g_idx" if self.method == "compressed-tensors" else "g_idx"

    def takes(self, suffix: str, dtype: torch.dtype) -> bool:
        """Whether a checkpoint tensor `<projection>.<suffix>` is part of a quantized projection. A g_idx the config
        does not ask for is taken too (and must then be trivial); compressed-tensors' int8 `weight` is told from a
        float one (an unquantized layer's) by its dtype."""
        if suffix == "weight":
            return "weight" in self.parts and dtype == torch.int8
        return suffix in self.parts or suffix == self.g_idx

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        return all(p in parts for p in self.parts)

    def repack(self, parts: dict[str, torch.Tensor], n: int, k: int, dtype: torch.dtype, name: str) -> Repacked:
        """A projection's tensors (already on the device) -> its weight [n, k] in sluice's format, scales in dtype."""
        check = _Shapes(name)
        if self.method == "gptq":
            groups = self._groups(k, name)
            q = _unpack(check(parts, "qweight", (k // 8, n)), 4, dim=0)  # [K, N]
            # v1 stores z - 1 in four bits: read back as gptqmodel does, (stored + 1) mod 16
            z = (_unpack(check(parts, "qzeros", (groups, n // 8)), 4, dim=1).int() + self.zero_offset) & 0xF
            scales = check(parts, "scales", (groups, n)).float()
            return self._int4(q.T, scales.T, (scales * (8 - z)).T, k, parts.get(self.g_idx), dtype, name)
        if self.method == "awq":
            groups = self._groups(k, name)
            q = _unpack(check(parts, "qweight", (k, n // 8)), 4, dim=1, order=AWQ_REVERSE_ORDER)
            z = _unpack(check(parts, "qzeros", (groups, n // 8)), 4, dim=1, order=AWQ_REVERSE_ORDER).int()
            scales = check(parts, "scales", (groups, n)).float()
            return self._int4(q.T, scales.T, (scales * (8 - z)).T, k, None, dtype, name)
        return self._compressed_tensors(parts, n, k, dtype, name, check)

    def _compressed_tensors(self, parts, n: int, k: int, dtype: torch.dtype, name: str, check) -> Repacked:
        groups = self._groups(k, name)
        scale = check(parts, "weight_scale", (n, groups)).float()
        if "weight_shape" in parts and parts["weight_shape"].tolist() != [n, k]:
            raise ModelError(f"tensor {name}.weight_shape is {parts['weight_shape'].tolist()}, the config implies "
                             f"{[n, k]}")
        if self.bits == 8:
            if "weight" in parts:
                q = check(parts, "weight", (n, k))
            else:
                q = (_unpack(check(parts, "weight_packed", (n, -(-k // 4))), 8, dim=1)[:, :k].int() - 128)
            return Repacked((q.to(torch.int8), scale[:, 0].to(dtype)), None)
        q = _unpack(check(parts, "weight_packed", (n, -(-k // 8))), 4, dim=1)[:, :k]  # stored as q + 8: ours
        zero = torch.zeros_like(scale)
        if not self.symmetric:  # w = (q - zp) * scale, zp signed and packed along the output rows
            zp = _unpack(check(parts, "weight_zero_point", (-(-n // 8), groups)), 4, dim=0)[:n].int() - 8
            zero = -zp * scale
        return self._int4(q, scale, zero, k, parts.get(self.g_idx), dtype, name)

    def _groups(self, k: int, name: str) -> int:
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ModelError(f"{name}: in_features {k} is not a multiple of the checkpoint's group_size {group}")
        return k // group

    def _int4(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, g_idx: torch.Tensor | None,
              dtype: torch.dtype, name: str) -> Repacked:
        """q [N, K] in 0..15 with float32 scales and zeros [N, groups] of the checkpoint's group -> Repacked."""
        group = k if self.group_size == -1 else self.group_size
        perm = None
        if g_idx is not None and not torch.equal(g_idx.long(), _plain_g_idx(k, group, g_idx.device)):
            if not self.act_order:
                raise ModelError(f"tensor {name}.{self.g_idx} reorders the columns, which the config's "
                                 f"quantization_config does not say (desc_act/actorder)")
            g_idx = g_idx.long()
            if g_idx.shape != (k,) or torch.bincount(g_idx, minlength=k // group).ne(group).any():
                raise ModelError(f"tensor {name}.{self.g_idx} does not put {group} columns in each group")
            perm = torch.argsort(g_idx, stable=True)
            q = q[:, perm]
        target = next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if group % g == 0 and k % g == 0), None)
        if target is None:
            raise ModelError(f"{name}: group_size {group} over in_features {k} has no INT4 group of "
                             f"{INT4_GROUP_SIZES} dividing it")
        reps = group // target
        scales, zeros = (t.repeat_interleave(reps, dim=1).to(dtype).contiguous() for t in (scales, zeros))
        return Repacked((pack_int4(q.contiguous()), scales, zeros), target, perm)


class _Shapes:
    """Fetches a part, checking its shape; the error names the tensor."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, parts: dict[str, torch.Tensor], suffix: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = parts[suffix]
        if tuple(t.shape) != shape:
            raise ModelError(f"tensor {self.name}.{suffix} has shape {tuple(t.shape)}, the config implies {shape}")
        return t


def _plain_g_idx(k: int, group: int, device) -> torch.Tensor:
    return torch.arange(k, device=device) // group


def _unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding 32 // bits values each, lowest bits first, along `dim` -> uint8 values, that dim
    32 // bits times longer. `order`: the value at position m of each word is in slot order[m]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[list(order)]
    words = packed.to(torch.int32)
    if dim == 0:  # [W, C] -> [W, per, C] -> [W * per, C]
        values = (words[:, None, :] >> shifts[None, :, None]) & (1 << bits) - 1
        return values.reshape(-1, words.shape[1]).to(torch.uint8)
    values = (words[:, :, None] >> shifts[None, None, :]) & (1 << bits) - 1
    return values.reshape(words.shape[0], -1).to(torch.uint8)


def checkpoint_quantization(raw: dict, source: str = "config.json") -> Prequantized | None:
    """config.json's quantization_config read, or None for a float checkpoint; ModelError for what is unsupported."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "unknown")).lower() if isinstance(quant, dict) else "unknown"
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ModelError(f"{source}: quantization method {method!r} is not supported; pre-quantized checkpoints may "
                         f"be {', '.join(readers)} (INT4, or INT8 per channel, weight-only), or use the float "
                         f"checkpoint with --quantization int8/int4 (quantization='int8'/'int4')")

    def refuse(what: str):
        raise ModelError(f"{source}: unsupported {method} checkpoint: {what}")

    return readers[method](quant, refuse)


def _group(value, refuse) -> int:
    group = -1 if value in (None, -1) else value
    if group != -1 and (not isinstance(group, int) or group <= 0 or group % min(INT4_GROUP_SIZES)):
        refuse(f"group_size {value!r} (supported: a multiple of {min(INT4_GROUP_SIZES)}, or -1 per channel)")
    return group


def _gptq(q: dict, refuse) -> Prequantized:
    if q.get("bits") != 4:
        refuse(f"{q.get('bits')}-bit weights (supported: 4-bit)")
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        refuse(f"checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    act_order = bool(q.get("desc_act", False))
    return Prequantized("gptq", 4, _group(q.get("group_size", 128), refuse),
                        ("qweight", "qzeros", "scales") + (("g_idx",) if act_order else ()),
                        act_order=act_order, zero_offset=1 if fmt == "gptq" else 0, symmetric=q.get("sym", True))


def _awq(q: dict, refuse) -> Prequantized:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        refuse(f"{bits}-bit weights (supported: 4-bit)")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        refuse(f"version {version!r} (supported: gemm)")
    if not q.get("zero_point", True):
        refuse("zero_point false (supported: AWQ with zero points)")
    return Prequantized("awq", 4, _group(q.get("group_size", q.get("q_group_size", 128)), refuse),
                        ("qweight", "qzeros", "scales"), symmetric=False)


def _compressed_tensors(q: dict, refuse) -> Prequantized:
    for key, what in (("kv_cache_scheme", "a quantized KV cache (kv_cache_scheme)"),
                      ("sparsity_config", "sparsity (sparsity_config)"), ("transform_config", "transforms")):
        if q.get(key):
            refuse(what)
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        refuse("no config_groups")
    if any(g.get("weights") != groups[0].get("weights") for g in groups):
        refuse("config_groups with different weight schemes")
    group = groups[0]
    w = group.get("weights") or refuse("config_groups without weights")
    bits, kind = w.get("num_bits"), w.get("type", "int")
    scheme = f"W{bits}A{(group.get('input_activations') or {}).get('num_bits', 16)}"
    if group.get("input_activations") or group.get("output_activations"):
        refuse(f"{scheme}: activations quantized (supported: weight-only W4A16, W8A16)")
    if kind != "int":
        refuse(f"{kind} {bits}-bit weights (supported: int)")
    if bits not in (4, 8):
        refuse(f"{bits}-bit weights (supported: 4 and 8)")
    fmt = group.get("format") or q.get("format")
    strategy, symmetric = w.get("strategy"), w.get("symmetric", True)
    if w.get("dynamic"):
        refuse("dynamic weight quantization")
    if bits == 8 and (strategy != "channel" or not symmetric or fmt not in INT8_FORMATS):
        refuse(f"W8A16 with strategy {strategy!r}, symmetric {symmetric}, format {fmt!r} (supported: symmetric, "
               f"channel, {', '.join(INT8_FORMATS)}: sluice's INT8 has one scale per output channel)")
    if bits == 4 and (strategy not in ("group", "channel") or fmt != "pack-quantized"):
        refuse(f"W4A16 with strategy {strategy!r}, format {fmt!r} (supported: group or channel, pack-quantized)")
    act_order = w.get("actorder") in ("group", True)
    if bits == 8 and fmt != "pack-quantized":
        parts = ("weight", "weight_scale")
    else:
        parts = ("weight_packed", "weight_scale", "weight_shape") + (() if symmetric else ("weight_zero_point",))
    return Prequantized("compressed-tensors", bits, _group(w.get("group_size"), refuse) if strategy == "group" else -1,
                        parts + (("weight_g_idx",) if act_order else ()), act_order=act_order, symmetric=symmetric)
