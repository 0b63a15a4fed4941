"""Which adapter a forward's rows use, and where their prompts' KV is cached (issue #29): shared by the
decode loop (serving/batcher.py) and the re-warm on reload (serving/rewarm.py)."""

from __future__ import annotations

import contextlib
from typing import Any


def prefix_key(policy: Any, adapter: Any):
    """Where a prompt's KV is cached: under the policy's version, and its adapter's key when it has
    one (another adapter's KV of the same tokens differs)."""
    return policy.version if adapter is None else (policy.version, adapter)


def route(policy: Any, adapters: list, counts: list[int] | None = None):
    """The forward's rows routed to their adapters (serving/multi_lora.py) when any row has one."""
    if all(a is None for a in adapters):
        return contextlib.nullcontext()
    multi = getattr(policy.model, "clawflow_multi_lora", None)
    if multi is None:
        raise RuntimeError("a row names an adapter, and its policy's model serves none")
    return multi.route(adapters, counts)


def loaded(policy: Any, adapter: Any) -> bool:
    """Whether `policy`'s model can run rows of `adapter` (None: always)."""
    multi = getattr(policy.model, "clawflow_multi_lora", None)
    return adapter is None or (multi is not None and adapter in multi.keys())
