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
  `unload(key)` add or drop one adapter without touching another's. Adapters of one rank share
  slots (the same slot in every Linear), so decode rows of many users gather their A and B with one
  tensor of slots and two batched matmuls per Linear.
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
    (a prompt chunk, or every row), each a view; `slotted` the other rows whose adapters have a slot,
    as (rows, slots), applied in one batched matmul per Linear; `loose` the rest, (row, key) each."""

    rows: int
    spans: tuple[tuple[int, int, Hashable], ...] = ()
    slotted: tuple[torch.Tensor, torch.Tensor] | None = None
    loose: tuple[tuple[int, Hashable], ...] = ()


class _Router:
    """Which adapter each flat row of the next forward uses, shared by every wrapped Linear. A
    forward runs on one thread (the decode loop), so a plain attribute under a lock is enough."""

    def __init__(self) -> None:
        self.routing: _Routing | None = None  # None: not routed (every row on the default)
        self.default: Hashable | None = None  # the adapter of rows that name none
        self.lock = threading.Lock()


class MultiLoraLinear(torch.nn.Module):
    """A base Linear plus, per routed adapter, its low-rank delta on that adapter's rows. For
    inference: the deltas are added to the base's output in place."""

    def __init__(self, base: torch.nn.Module, router: _Router):
        super().__init__()
        self.base, self._router = base, router
        self.deltas: dict[Hashable, LoraDelta] = {}  # a slotted adapter's: views of its slot
        # every slotted adapter's A and B, by the slot MultiLora gave it (zero where it leaves this
        # Linear as it is): [slots, in, r] and [slots, r, out]; None until the first one
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.in_features = getattr(base, "in_features", None)
        self.out_features = getattr(base, "out_features", None)

    def put(self, key: Hashable, slot: int | None, d: LoraDelta | None, slots: int) -> None:
        """`key`'s delta here: into `slot` of `slots` (zeros when d is None: the adapter leaves this
        Linear as it is), or held apart when it has no slot (another rank: `slot` None)."""
        if slot is None:
            if d is not None:
                self.deltas[key] = d
            return
        if self.a is None:  # no slotted adapter adapted this Linear yet: nothing to zero
            if d is None:
                return
            self.a = d.a_t.new_zeros((slots, *d.a_t.shape))
            self.b = d.b_t.new_zeros((slots, *d.b_t.shape))
        if d is None:  # a freed slot may hold an unloaded adapter's delta
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(d.a_t)
        self.b[slot].copy_(d.b_t)
        self.deltas[key] = LoraDelta(self.a[slot], self.b[slot])

    def grow(self, slots: int, slot_of: dict[Hashable, int]) -> None:
        """Room for `slots` slotted adapters; the views in `deltas` follow the new tensors."""
        if self.a is None:
            return
        have = self.a.shape[0]
        self.a = torch.cat([self.a, self.a.new_zeros((slots - have, *self.a.shape[1:]))])
        self.b = torch.cat([self.b, self.b.new_zeros((slots - have, *self.b.shape[1:]))])
        for key, slot in slot_of.items():
            if key in self.deltas:
                self.deltas[key] = LoraDelta(self.a[slot], self.b[slot])

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
            if routing.slotted is not None and self.a is not None:
                # decode rows of several users: their A and B gathered by slot, two batched matmuls.
                # Per adapter (gather, two matmuls, scatter each) the small ops' dispatch cost more
                # than their math: 8 rows on 8 adapters, ~40 against ~16 ms a step over SmolLM2's
                # 210 Linears (1 thread, docs/performance.md)
                rows, slots = routing.slotted
                delta = torch.bmm(torch.bmm(flat_x.index_select(0, rows).unsqueeze(1), self.a.index_select(0, slots)),
                                  self.b.index_select(0, slots))
                flat_y.index_add_(0, rows, delta.squeeze(1))
            for row, key in routing.loose:
                if (d := self.deltas.get(key)) is not None:
                    flat_y[row:row + 1].addmm_(flat_x[row:row + 1] @ d.a_t, d.b_t)
        return y


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
            shared[id(layer.a)], shared[id(layer.b)] = None, None
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
        # slots: every adapter of the first one's rank has the same slot in every Linear, so one
        # forward's decode rows gather their A and B with one tensor of slots for all 210 Linears;
        # written on load, freed on unload, never copied again (growth aside)
        self._slot_of: dict[Hashable, int] = {}
        self._free: list[int] = []
        self._rank: int | None = None
        self._edit = threading.Lock()  # one load or unload at a time

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
        ranks = {d.a_t.shape[1] for d in deltas.values()}
        # Not under the router's lock: waiting for it (the decode loop takes it back-to-back) held a
        # user's reload up to 1.1 s. Nothing in flight reads what this writes: a free slot belongs to
        # no routed key, and growth copies every live slot before the views move.
        with self._edit:
            slot = None
            if len(ranks) == 1 and (self._rank is None or ranks == {self._rank}):
                self._rank = next(iter(ranks))
                if not self._free:
                    self._grow()
                slot = self._slot_of[key] = self._free.pop()
            for name, layer in self.layers.items():
                layer.put(key, slot, deltas.get(name), self._slots())
            self._keys.add(key)
        return sum(d.nbytes for d in deltas.values())

    def _grow(self) -> None:
        """More slots: a quarter more (at least 4), so `serving.max_loaded_adapters` and a user's
        reloading version leave few empty."""
        have = self._slots()
        more = max(4, have // 4)
        for layer in self.layers.values():
            layer.grow(have + more, self._slot_of)
        self._free = list(range(have + more - 1, have - 1, -1))

    def _slots(self) -> int:
        return len(self._slot_of) + len(self._free)

    def deltas(self, key: Hashable) -> dict[str, LoraDelta]:
        """A loaded adapter's deltas (views of its slots), to load it on another base's MultiLora."""
        return {name: layer.deltas[key] for name, layer in self.layers.items() if key in layer.deltas}

    def unload(self, key: Hashable) -> None:
        if key == self._router.default:
            raise ValueError(f"{key!r} is the default adapter; set another default first")
        with self._edit:  # the engine unloads between forwards, on the decode thread
            for layer in self.layers.values():
                layer.deltas.pop(key, None)
            if (slot := self._slot_of.pop(key, None)) is not None:
                self._free.append(slot)
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
            self._router.routing = _routing(adapters, counts, self._slot_of)
            try:
                yield
            finally:
                self._router.routing = None


def _routing(adapters: Sequence[Hashable | None], counts: Sequence[int], slot_of: dict[Hashable, int]) -> _Routing:
    """Segments (adapter, count) in row order as spans, slotted rows and loose rows (None: no
    adapter, the base)."""
    total = sum(counts)
    distinct = set(adapters)
    if distinct <= {None}:
        return _Routing(total)
    if len(distinct) == 1:  # every row on one adapter: one span, no gather
        return _Routing(total, ((0, total, adapters[0]),))
    spans, singles, at = [], [], 0
    for a, n in zip(adapters, counts):
        if a is not None:
            if n == 1:
                singles.append((at, a))
            else:
                spans.append((at, at + n, a))
        at += n
    if len({a for _, a in singles}) == 1:  # one adapter's decode rows: spans of the consecutive ones
        for row, a in singles:
            if spans and spans[-1][1] == row and spans[-1][2] == a:
                spans[-1] = (spans[-1][0], row + 1, a)
            else:
                spans.append((row, row + 1, a))
        return _Routing(total, tuple(spans))
    slotted = [(row, slot_of[a]) for row, a in singles if a in slot_of]
    loose = tuple((row, a) for row, a in singles if a not in slot_of)
    return _Routing(total, tuple(spans), (torch.tensor([r for r, _ in slotted]), torch.tensor([s for _, s in slotted]))
                    if slotted else None, loose)
