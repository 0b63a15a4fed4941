"""Both engines implement `engine_protocol.Engine`: every member, with the protocol's signature.

`isinstance` on a runtime-checkable protocol only checks that the names exist, so the method
signatures are compared as well (parameter names, kinds and defaults: the gateway calls them by
keyword and position alike)."""

from __future__ import annotations

import inspect

import pytest

from clawflow.serving.engine import TorchEngine
from clawflow.serving.engine_protocol import Engine, EngineStats
from clawflow.serving.sglang import SGLangEngine
from conftest import free_port

ENGINES = [TorchEngine, SGLangEngine]


def _members() -> tuple[dict[str, object], set[str]]:
    """The protocol's methods and properties by name, and its plain attributes."""
    members = {n: v for n, v in vars(Engine).items()
               if (callable(v) or isinstance(v, property)) and not n.startswith("_")}
    return members, set(Engine.__annotations__)


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_engine_methods_match_the_protocol(cls):
    methods, _ = _members()
    assert {"encode_chat", "submit", "score", "reload", "stats", "policy_version"} <= set(methods)
    for name, want in methods.items():
        got = inspect.getattr_static(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} should be a property"
            continue
        assert _params(got) == _params(want), f"{cls.__name__}.{name}{inspect.signature(got)}"


def test_both_engines_are_engines(tiny_model_dir):
    torch_engine = TorchEngine(tiny_model_dir, max_batch=2, max_queue=2)
    # nothing listens on the port: the adapter starts anyway and checks its logprobs later
    sglang_engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", tiny_model_dir, timeout_s=5)
    try:
        for engine in (torch_engine, sglang_engine):
            assert isinstance(engine, Engine)
            assert all(hasattr(engine, a) for a in _members()[1])
            assert engine.stats() == EngineStats(queue_depth=0, active=0)  # idle: every counter 0
        assert torch_engine.dtype is not None and sglang_engine.dtype is None
    finally:
        torch_engine.close()
        sglang_engine.close()
