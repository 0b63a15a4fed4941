"""Many LoRA adapters on one base model, each applied to its own rows of one forward (issue #29).

Why: a decode step on CPU is bound by reading the base weights (540 MB for SmolLM2-135M in fp32).
Serving each user's adapter as its own model, in its own batch, reads them once per adapter per
step. Here every target Linear of the base runs once over all the rows, and each adapter adds its
low-rank delta, `scale * (x A^T) B^T`, to its own rows only (the grouping of S-LoRA / Punica, in
plain torch). The base weights are never modified, so a row with no adapter gets exactly the base.

- `read_adapter` reads a peft LoRA adapter directory (what the trainer writes) into per-module
  deltas, refusing what it cannot apply exactly (DoRA, trained biases, extra saved modules, a
  module or shape the base does not have).
- `MultiLora(model)` wraps every Linear of the decoder layers once; `load(key, deltas)` and
  `unload(key)` add or drop one adapter without touching another's.
- `route(adapters, counts)` says, for the next forward, which adapter each segment of the flat rows
  uses (a decode row is one row; a prompt chunk is `count` rows). Every wrapped Linear reads it.
  It works for the fused step's flat `[N, D]` rows and for transformers' `[B, T, D]` alike.
- `default`: the adapter of rows that name none, and of every row of a forward nobody routed. The
  engine serves a LoRA shared policy this way, so each user's adapter (trained on the same base)
  replaces it on that user's rows instead of stacking on it.

An adapter's deltas are immutable once loaded: a reload loads the new version under a new key, so
rows already decoding on the old version finish on it.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawflow.policy.loader import ADAPTER_CONFIG  # the trainer's adapter directories
from clawflow.serving.generation import AdapterError

__all__ = ["AdapterError", "LoraDelta", "MultiLora", "read_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # peft's prefix on every saved key


@dataclass(frozen=True)
class LoraDelta:
    """One module's adapter, ready to apply: y += (x @ a_t) @ b_t, the scale folded into b_t."""

    a_t: torch.Tensor  # [in, r]
    b_t: torch.Tensor  # [r, out], times alpha / r

    @property
    def nbytes(self) -> int:
        return self.a_t.numel() * self.a_t.element_size() + self.b_t.numel() * self.b_t.element_size()


def read_adapter(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, LoraDelta]:
    """A peft LoRA adapter directory as {module name in the base model: its delta}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        weights = load_file(str(path / ADAPTER_WEIGHTS))
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterError(f"cannot read adapter {path}: {exc.__class__.__name__}: {exc}") from exc
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {path} is {cfg.get('peft_type')}, not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "saved modules")):
        if cfg.get(key):
            raise AdapterError(f"adapter {path} uses {why}, which is not served per row")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {path} trains biases, which is not served per row")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):  # per-module scales: not read here
        raise AdapterError(f"adapter {path} sets a rank or alpha per module, which is not served per row")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"adapter {path} holds {key}, not a LoRA A/B weight")
        name, part = key[len(_PREFIX):].rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        pairs.setdefault(name, {})[part] = tensor
    deltas = {}
    for name, p in pairs.items():
        a, b = p.get("lora_A"), p.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {path}: module {name} has no matching A and B")
        deltas[name] = LoraDelta(a.to(dtype).t().contiguous(), (b.to(dtype) * scale).t().contiguous())
    if not deltas:
        raise AdapterError(f"adapter {path} holds no LoRA weights")
    return deltas


@dataclass(frozen=True)
class _Routing:
    """One forward's rows by adapter: `spans` (start, stop, key) of contiguous rows on one adapter
    (a prompt chunk, or every row), each a view; `singles` the rows left, one adapter each (decode
    rows of different users), as (keys, rows) applied in one batched matmul."""

    rows: int
    spans: tuple[tuple[int, int, Hashable], ...] = ()
    singles: tuple[tuple[Hashable, ...], torch.Tensor] | None = None


class _Router:
    """Which adapter each flat row of the next forward uses, shared by every wrapped Linear. A
    forward runs on one thread (the decode loop), so a plain attribute under a lock is enough."""

    def __init__(self) -> None:
        self.routing: _Routing | None = None  # None: not routed (every row on the default)
        self.default: Hashable | None = None  # the adapter of rows that name none
        self.lock = threading.Lock()


class _Slots:
    """The same-shaped adapters of one Linear in one pair of tensors, one slot each, so decode rows of
    many users gather their A and B with one `index_select` each. A slot is written once on load and
    freed on unload (never copied again); full, the tensors grow by a quarter (at least 4 slots), so
    `serving.max_loaded_adapters` plus a reloading user's old version costs few empty slots."""

    def __init__(self, a_t: torch.Tensor, b_t: torch.Tensor):
        self.a = a_t.new_zeros((2, *a_t.shape))  # [slots, in, r]
        self.b = b_t.new_zeros((2, *b_t.shape))  # [slots, r, out]
        self.free = [1, 0]

    def add(self, d: LoraDelta) -> int:
        if not self.free:
            n, more = self.a.shape[0], max(4, self.a.shape[0] // 4)
            self.a = torch.cat([self.a, self.a.new_zeros((more, *self.a.shape[1:]))])
            self.b = torch.cat([self.b, self.b.new_zeros((more, *self.b.shape[1:]))])
            self.free = list(range(n + more - 1, n - 1, -1))
        slot = self.free.pop()
        self.a[slot].copy_(d.a_t)
        self.b[slot].copy_(d.b_t)
        return slot


class MultiLoraLinear(torch.nn.Module):
    """A base Linear plus, per routed adapter, its low-rank delta on that adapter's rows. For
    inference: the deltas are added to the base's output in place."""

    def __init__(self, base: torch.nn.Module, router: _Router):
        super().__init__()
        self.base, self._router = base, router
        self.deltas: dict[Hashable, LoraDelta] = {}  # views into their slots
        self._slots: dict[tuple, _Slots] = {}  # by (A's shape, B's shape)
        self._slot_of: dict[Hashable, int] = {}
        self.in_features = getattr(base, "in_features", None)
        self.out_features = getattr(base, "out_features", None)

    def add(self, key: Hashable, d: LoraDelta) -> None:
        shape = (tuple(d.a_t.shape), tuple(d.b_t.shape))
        slots = self._slots.get(shape)
        if slots is None:
            slots = self._slots[shape] = _Slots(d.a_t, d.b_t)
        before = slots.a
        self._slot_of[key] = slots.add(d)
        if slots.a is not before:  # grown: the views of the old tensors are re-pointed
            for k, old in list(self.deltas.items()):
                if (tuple(old.a_t.shape), tuple(old.b_t.shape)) == shape:
                    self.deltas[k] = LoraDelta(slots.a[self._slot_of[k]], slots.b[self._slot_of[k]])
        self.deltas[key] = LoraDelta(slots.a[self._slot_of[key]], slots.b[self._slot_of[key]])

    def drop(self, key: Hashable) -> None:
        d = self.deltas.pop(key, None)
        if d is not None:
            self._slots[(tuple(d.a_t.shape), tuple(d.b_t.shape))].free.append(self._slot_of.pop(key))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        routing = self._router.routing
        if routing is None:  # not routed: every row on the default adapter, if there is one
            d = self.deltas.get(self._router.default) if self._router.default is not None else None
            if d is not None:
                with _one_thread():
                    y.view(-1, y.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]) @ d.a_t, d.b_t)
            return y
        if not self.deltas:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if flat_x.shape[0] != routing.rows:
            raise RuntimeError(f"routed {routing.rows} rows, the forward has {flat_x.shape[0]}")
        with _one_thread():
            for start, stop, key in routing.spans:
                if (d := self.deltas.get(key)) is not None:  # None: this adapter leaves the module as is
                    flat_y[start:stop].addmm_(flat_x[start:stop] @ d.a_t, d.b_t)
            if routing.singles is not None:
                self._singles(flat_x, flat_y, *routing.singles)
        return y

    def _singles(self, flat_x: torch.Tensor, flat_y: torch.Tensor, keys: tuple, rows: torch.Tensor) -> None:
        """One row per adapter, several adapters: the A and B of same-shaped ones gathered from their
        slots, two batched matmuls. Per adapter (gather, two matmuls, scatter each) the small ops'
        dispatch cost more than their math: 8 rows on 8 adapters, ~40 against ~16 ms a step over
        SmolLM2's 210 Linears (1 thread, docs/performance.md)."""
        by_shape: dict[tuple, list[int]] = {}
        for i, k in enumerate(keys):
            if (d := self.deltas.get(k)) is not None:  # None: this adapter leaves the module as is
                by_shape.setdefault((d.a_t.shape, d.b_t.shape), []).append(i)
        for members in by_shape.values():
            deltas = [self.deltas[keys[i]] for i in members]
            if len(members) == 1:
                row = int(rows[members[0]])
                flat_y[row:row + 1].addmm_(flat_x[row:row + 1] @ deltas[0].a_t, deltas[0].b_t)
                continue
            idx = rows if len(members) == len(keys) else rows[members]
            slots = self._slots[(tuple(deltas[0].a_t.shape), tuple(deltas[0].b_t.shape))]
            at = torch.tensor([self._slot_of[keys[i]] for i in members])
            a, b = slots.a.index_select(0, at), slots.b.index_select(0, at)  # [m, in, r], [m, r, out]
            flat_y.index_add_(0, idx, torch.bmm(torch.bmm(flat_x.index_select(0, idx).unsqueeze(1), a), b).squeeze(1))


@contextlib.contextmanager
def _one_thread():
    """The deltas' ops on one intra-op thread. They are tiny (8 rows x 576 x 16): in the engine a
    matmul of that size took ~200 us on 2 threads and 8 us on 1, and 8 users' rows on 8 adapters
    decoded 10.6 tok/s against 37.6 with this (SmolLM2, 2 cores, docs/performance.md). The base
    Linear around them keeps every thread."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _decoder_linears(model) -> Iterator[tuple[torch.nn.Module, str, str]]:
    """(parent, attribute, full name) of every Linear inside the decoder layers (not the head)."""
    for name, module in model.named_modules():
        if ".layers." not in f".{name}.":
            continue
        for child_name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):  # packed and bf16 Linears are Linears too
                yield module, child_name, f"{name}.{child_name}"


def plain_copy(model: Any) -> Any:
    """New modules over the same weight tensors, with no adapter wrapped in: the engine's shell for
    one more policy on a base it already holds (MultiLoraLinear back to its base Linear)."""
    import copy
    import itertools

    shared: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    multi = model.__dict__.get("clawflow_multi_lora")
    if multi is not None:  # neither its router (a lock) nor the users' deltas are copied
        shared[id(multi)] = None
        for layer in multi.layers.values():
            shared[id(layer._router)], shared[id(layer.deltas)] = None, {}
            shared[id(layer._slots)], shared[id(layer._slot_of)] = {}, {}
    shell = copy.deepcopy(model, shared)
    for parent in list(shell.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MultiLoraLinear):
                setattr(parent, name, child.base)
    for attr in ("clawflow_multi_lora", "clawflow_adapter_base"):
        shell.__dict__.pop(attr, None)
    return shell


class MultiLora:
    """The adapters served on one base model: `load`, `unload`, and `route` for each forward."""

    def __init__(self, model: Any):
        """Wrap `model`'s decoder Linears, in place; `model` is a plain base (for inference), not a
        peft model and not wrapped already."""
        if hasattr(model, "peft_config") or any(isinstance(m, MultiLoraLinear) for m in model.modules()):
            raise ValueError("MultiLora wraps a plain base model once (not a peft model, not twice)")
        self.model = model
        self._router = _Router()
        self.layers: dict[str, MultiLoraLinear] = {}
        for parent, attr, name in list(_decoder_linears(model)):
            wrapped = MultiLoraLinear(getattr(parent, attr), self._router)
            setattr(parent, attr, wrapped)
            self.layers[name] = wrapped
        self._keys: set[Hashable] = set()

    def keys(self) -> set[Hashable]:
        return set(self._keys)

    @property
    def default(self) -> Hashable | None:
        return self._router.default

    @default.setter
    def default(self, key: Hashable | None) -> None:
        """Rows that name no adapter (and unrouted forwards) use `key`'s; None: the base alone."""
        if key is not None and key not in self._keys:
            raise KeyError(f"adapter not loaded: {key!r}")
        self._router.default = key

    def load(self, key: Hashable, deltas: dict[str, LoraDelta]) -> int:
        """Serve `deltas` under `key` (a new key: a loaded adapter is never changed in place).
        Checked whole before anything is installed: an AdapterError leaves every adapter as it was.
        Returns the adapter's bytes."""
        if key in self._keys:
            raise AdapterError(f"an adapter is already loaded as {key!r}")
        for name, d in deltas.items():
            layer = self.layers.get(name)
            if layer is None:
                raise AdapterError(f"the adapter adapts {name}, which the base model does not have")
            if (layer.in_features, layer.out_features) != (d.a_t.shape[0], d.b_t.shape[1]) \
                    or d.a_t.shape[1] != d.b_t.shape[0]:
                raise AdapterError(f"the adapter's {name} is {tuple(d.a_t.shape)} x {tuple(d.b_t.shape)}, "
                                   f"the base's Linear {layer.in_features} -> {layer.out_features}")
        with self._router.lock:  # between forwards: no row reads a slot while it is written
            for name, d in deltas.items():
                self.layers[name].add(key, d)
            self._keys.add(key)
        return sum(d.nbytes for d in deltas.values())

    def deltas(self, key: Hashable) -> dict[str, LoraDelta]:
        """A loaded adapter's deltas (views of its slots), to load it on another base's MultiLora."""
        return {name: layer.deltas[key] for name, layer in self.layers.items() if key in layer.deltas}

    def unload(self, key: Hashable) -> None:
        if key == self._router.default:
            raise ValueError(f"{key!r} is the default adapter; set another default first")
        with self._router.lock:
            for layer in self.layers.values():
                layer.drop(key)
            self._keys.discard(key)

    @contextlib.contextmanager
    def unrouted(self):
        """For forwards off the decode thread (scoring): every row on the default adapter, never
        on rows another thread routed meanwhile."""
        with self._router.lock:
            yield

    @contextlib.contextmanager
    def route(self, adapters: Sequence[Hashable | None], counts: Sequence[int] | None = None):
        """For the forwards inside: segment i of the flat rows (`counts[i]` rows, 1 when `counts` is
        None) uses adapter `adapters[i]`, None = the default (or the base alone when there is no
        default). Rows are in segment order."""
        counts = [1] * len(adapters) if counts is None else list(counts)
        if len(counts) != len(adapters):
            raise ValueError("one count per adapter")
        default = self._router.default
        adapters = [default if a is None else a for a in adapters]
        unknown = {a for a in adapters if a is not None} - self._keys
        if unknown:
            raise KeyError(f"adapters not loaded: {sorted(map(str, unknown))}")
        with self._router.lock:
            self._router.routing = _routing(adapters, counts)
            try:
                yield
            finally:
                self._router.routing = None


def _routing(adapters: Sequence[Hashable | None], counts: Sequence[int]) -> _Routing:
    """Segments (adapter, count) in row order as spans and singles (None: no adapter, the base)."""
    total = sum(counts)
    distinct = set(adapters)
    if distinct <= {None}:
        return _Routing(total)
    if len(distinct) == 1:  # every row on one adapter: one span, no gather
        return _Routing(total, ((0, total, adapters[0]),))
    spans, single_keys, single_rows, at = [], [], [], 0
    for a, n in zip(adapters, counts):
        if a is not None:
            if n == 1:
                single_keys.append(a)
                single_rows.append(at)
            else:
                spans.append((at, at + n, a))
        at += n
    singles = None
    if len(set(single_keys)) == 1:  # one adapter's decode rows: as spans of the consecutive ones
        for row in single_rows:
            if spans and spans[-1][1] == row and spans[-1][2] == single_keys[0]:
                spans[-1] = (spans[-1][0], row + 1, single_keys[0])
            else:
                spans.append((row, row + 1, single_keys[0]))
    elif single_keys:
        singles = (tuple(single_keys), torch.tensor(single_rows, dtype=torch.long))
    return _Routing(total, tuple(spans), singles)
