"""Linear layers on oneDNN's prepacked weights: the serving fast path for skinny matmuls.

A decode step multiplies every Linear weight by a handful of rows (one per stream). PyTorch's CPU
`F.linear` sends that to MKL's sgemm, which is slow for such shapes: on a 2-core AVX512 EPYC
SmolLM2-135M's decode-step Linears took 31 ms at 8 rows and its LM head 17 ms. oneDNN on the same
weights reordered once into its blocked layout (what torch.compile's CPU freezing path uses) took 14
and 6 ms; the result is still fp32 (max relative error ~1e-6, accumulation order). Prefill-sized
matmuls (512-2048 rows) came out 1.1-1.2x faster too.

`PackedLinear` is an `nn.Linear` (same Parameter, so tied weights stay tied and peft attaches LoRA
to it as to any Linear) that keeps a packed copy of its weight and uses it only where it is exact
and valid: fp32 input and weight on CPU with autograd off (serving runs under inference mode);
training and anything else take the plain path. A weight changed in place through torch ops is
packed again (a write through `.data` bypasses the version counter: unpack first). The copy costs
the Linear weights' size once more in memory (~540 MB for SmolLM2-135M with its LM head).
`PackedBF16Linear` does the same for bf16-weights' BF16Linear (bf16 packed: 1.2-1.6x over its plain
bf16 matmul at 1-32 rows on the same EPYC). oneDNN's bf16 path needs AVX512BW/VL/DQ or
AVX-NE-CONVERT: an AVX2-only EPYC raises on it, so each dtype is packed only where `can_pack` found
the op working on this CPU, and a bf16 model there stays on its plain bf16 matmul.

Whether it pays is measured, not assumed (`speedup`): `serving.linear_kernel: auto` times the
model's decode step both ways at start-up.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from clawflow.policy.bf16_weights import BF16Linear

log = logging.getLogger("clawflow.packed_linear")


def available() -> bool:
    """oneDNN is built in and has the prepacked-linear ops (internal ops of torch's CPU inductor)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


_can_pack: dict[torch.dtype, bool] = {}


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN packs and multiplies `dtype` weights on this CPU: tried once per process on a tiny
    weight (the op raises where the CPU lacks the instructions it needs; no CPU-name table)."""
    if dtype not in _can_pack:
        ok = available()
        if ok:
            try:
                w = torch.ones(8, 8, dtype=dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
            except RuntimeError as exc:
                log.info("oneDNN cannot pack %s weights on this CPU (%s)", dtype, str(exc).splitlines()[0])
                ok = False
        _can_pack[dtype] = ok
    return _can_pack[dtype]


class _Packed:
    """The packed weight and the weight version it was packed from. Shared, never copied, by
    `copy.deepcopy` (the engine copies a base model's modules over the same tensors for LoRA)."""

    def __init__(self, weight: torch.Tensor):
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.version = weight._version

    def __deepcopy__(self, memo: dict) -> "_Packed":
        return self


class PackedLinear(torch.nn.Linear):
    _packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, _current(self).tensor, self.bias, "none", [], "")


class PackedBF16Linear(BF16Linear):
    """A BF16Linear (bf16 weights under fp32 activations, policy/bf16_weights.py) on packed weights."""

    _packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.weight.dtype != torch.bfloat16 or x.device.type != "cpu":
            return super().forward(x)
        out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), _current(self).tensor, self.bias,
                                                 "none", [], "")
        return out.to(x.dtype)


def _current(module: torch.nn.Linear) -> _Packed:
    if module._packed.version != module.weight._version:  # changed in place since it was packed
        module._packed = _Packed(module.weight)
    return module._packed


# plain class -> (its packed class, the weight dtype it packs)
_PACKED = {torch.nn.Linear: (PackedLinear, torch.float32), BF16Linear: (PackedBF16Linear, torch.bfloat16)}


def pack_linears(model: Any) -> int:
    """Turn every plain fp32 CPU `nn.Linear` of `model` into a PackedLinear (and every BF16Linear
    into a PackedBF16Linear), in place, where this CPU can pack that dtype (`can_pack`): the module
    keeps its Parameters; the number turned."""
    n = 0
    for module in list(model.modules()):
        cls, dtype = _PACKED.get(type(module), (None, None))
        if cls is not None and module.weight.dtype == dtype and module.weight.device.type == "cpu" \
                and can_pack(dtype):
            module._packed = _Packed(module.weight)
            module.__class__ = cls
            n += 1
    return n


def unpack_linears(model: Any) -> None:
    """Undo `pack_linears` (the packed copies are freed)."""
    plain = {cls: base for base, (cls, _) in _PACKED.items()}
    for module in model.modules():
        if type(module) in plain:
            module.__class__ = plain[type(module)]
            del module._packed


@torch.inference_mode()
def _step_seconds(model: Any, rows: int, reps: int) -> float:
    """Best time of a forward of `rows` one-token rows (a decode step's matmul shapes)."""
    ids = torch.zeros(rows, 1, dtype=torch.long)
    model(ids)  # first call: kernel selection
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids)
        best = min(best, time.perf_counter() - t0)
    return best


MIN_SPEEDUP = 1.1  # packing is chosen only when clearly faster (noise could flip less)


def speedup(model: Any, rows: tuple[int, ...] = (1, 8), reps: int = 3) -> float:
    """How much faster `model`'s decode steps run on packed weights (plain seconds / packed seconds,
    summed over `rows`), measured here and now; `model` is left unpacked. ~1 s for SmolLM2-135M."""
    if not available():
        return 0.0
    plain = sum(_step_seconds(model, r, reps) for r in rows)
    try:
        if pack_linears(model) == 0:
            return 0.0
        packed = sum(_step_seconds(model, r, reps) for r in rows)
    finally:
        unpack_linears(model)
    return plain / packed


# (threads, the model's packable Linear shapes and dtypes) -> packing measured faster: measured once
# per process (the machine does not change; the gate loads a champion and a candidate per run)
_verdicts: dict[tuple, bool] = {}


def pack_if_faster(model: Any) -> bool:
    """Pack `model` when `speedup` measures it clearly faster here (once per model shape); whether it did."""
    key = (torch.get_num_threads(),
           tuple((tuple(m.weight.shape), m.weight.dtype) for m in model.modules() if type(m) in _PACKED))
    if key not in _verdicts:
        gain = speedup(model)
        _verdicts[key] = gain >= MIN_SPEEDUP
        log.info("oneDNN-packed Linears: %.2fx the plain decode step -> %s", gain,
                 "packed" if _verdicts[key] else "plain")
    return _verdicts[key] and pack_linears(model) > 0
