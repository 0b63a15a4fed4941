"""YAML data files (personas, probe sets) read with their line numbers, so a malformed entry gets a
one-line error naming the file and the line: `configs/envs/personas.yaml:12: persona terse: ...`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlDoc:
    """A parsed YAML file and its node tree; `error(...)` builds the located ValueError."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise ValueError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        try:
            self.data: Any = yaml.safe_load(text)
            self._root = yaml.compose(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{self.path}:{mark.line + 1}" if mark else str(self.path)
            raise ValueError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from exc

    def line(self, *keys: str | int) -> int:
        """1-based line of the deepest node found along `keys` (mapping keys, sequence indices)."""
        node = self._root
        line = node.start_mark.line + 1 if node is not None else 1
        for key in keys:
            child = None
            if isinstance(node, yaml.MappingNode):
                child = next((v for k, v in node.value if k.value == key), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
                child = node.value[key]
            if child is None:
                break
            node, line = child, child.start_mark.line + 1
        return line

    def error(self, message: str, *keys: str | int) -> ValueError:
        return ValueError(f"{self.path}:{self.line(*keys)}: {message}")

    def require(self, mapping: Any, key: str, kind: type | tuple[type, ...], *where: str | int) -> Any:
        """`mapping[key]`, checked to be a `kind`; else the located error."""
        if not isinstance(mapping, dict):
            raise self.error(f"expected a mapping, got {type(mapping).__name__}", *where)
        if key not in mapping:
            raise self.error(f"missing `{key}`", *where)
        value = mapping[key]
        if not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise self.error(f"`{key}` must be a {names}, got {type(value).__name__}", *where, key)
        return value
