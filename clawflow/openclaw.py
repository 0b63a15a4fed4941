"""OpenClaw's config (`~/.openclaw/openclaw.json`, JSON5) pointed at the gateway: `clawflow connect openclaw`.

What is written, and why (read in openclaw 2026.9.6's source, measured against a capturing server):

- `models.providers.clawflow = {baseUrl, apiKey, api: "openai-completions", models: [...]}` and
  `agents.defaults.model.primary = "clawflow/<model id>"`.
- `contextWindow` is declared as TWICE the served window. OpenClaw measures prompts as
  chars / 4 x 1.25 (SmolLM2's tokens x ~1.21 on its own prompt), keeps min(20000, 25 %) of the
  declared window as compaction reserve, and, for a proxy endpoint like this one, clamps
  `max_tokens` to window - estimate - 1: with the real 8192 declared, its ~7,700-token minimal
  prompt (estimated 9,289) was sent with `max_completion_tokens: 1`. At twice the window neither
  the clamp nor its early compaction triggers while the prompt fits the real window; the gateway
  enforces the real one with an OpenAI-style 400 ("maximum context length ..."), which OpenClaw
  recognises as a context overflow and answers by compacting the session and retrying.
  (`contextTokens` cannot do this: OpenClaw caps it at `contextWindow`.)
- `maxTokens` = the gateway's default completion budget (`serving.max_new_tokens`).
- `tools.profile: "minimal"` when the window is under `MINIMAL_TOOLS_BELOW`: OpenClaw's default
  agent prompt is ~12,900 SmolLM2 tokens, the minimal profile's ~7,700.

Everything else in the file is kept; the file is rewritten as 2-space JSON, as OpenClaw writes it
(so JSON5 comments do not survive: the backup keeps them).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import json5

PROVIDER = "clawflow"
WINDOW_FACTOR = 2  # declared contextWindow = WINDOW_FACTOR x the served window (module docstring)
MINIMAL_TOOLS_BELOW = 32768  # tokens; the default prompt (~12.9k) leaves too little room under it
MINIMAL_PROMPT_TOKENS = 7700  # OpenClaw's prompt with the minimal tools profile (SmolLM2 tokens)


class OpenClawConfigError(ValueError):
    """The config file cannot be read or is not a JSON5 object; the message is one line."""


@dataclass(frozen=True)
class Served:
    """What the gateway serves, as OpenClaw needs to know it."""

    base_url: str  # ends in /v1
    api_key: str
    model: str
    context_length: int
    max_tokens: int


def default_path(env: Mapping[str, str]) -> Path:
    """Where OpenClaw reads its config, as it resolves it: $OPENCLAW_CONFIG_PATH, else
    $OPENCLAW_STATE_DIR/openclaw.json, else ~/.openclaw/openclaw.json under $OPENCLAW_HOME or $HOME."""
    home = Path(env.get("OPENCLAW_HOME") or env.get("HOME") or "~").expanduser()

    def user_path(value: str) -> Path:
        return home / value[2:] if value == "~" or value.startswith("~/") else Path(value)

    if value := (env.get("OPENCLAW_CONFIG_PATH") or "").strip():
        return user_path(value)
    if value := (env.get("OPENCLAW_STATE_DIR") or "").strip():
        return user_path(value) / "openclaw.json"
    return home / ".openclaw" / "openclaw.json"


def model_entry(s: Served) -> dict[str, Any]:
    return {"id": s.model, "name": f"{s.model} (clawflow)", "reasoning": False, "input": ["text"],
            "contextWindow": WINDOW_FACTOR * s.context_length, "maxTokens": s.max_tokens}


def _at(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The object at `keys`, created when missing (a non-object there is replaced)."""
    node = config
    for key in keys:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    return node


def merge(config: dict[str, Any], s: Served) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `config` pointed at the gateway, one line per setting changed). Other providers,
    other models of ours, and every unrelated setting are kept."""
    new = copy.deepcopy(config)
    changes: list[str] = []

    def put(node: dict[str, Any], key: str, value: Any, label: str) -> None:
        if node.get(key) != value:
            before, after = ("***", "***") if key == "apiKey" else (_short(node.get(key)), _short(value))
            changes.append(f"{label}: {before} → {after}")
            node[key] = value

    provider = _at(new, "models", "providers", PROVIDER)
    where = f"models.providers.{PROVIDER}"
    put(provider, "baseUrl", s.base_url, f"{where}.baseUrl")
    put(provider, "apiKey", s.api_key, f"{where}.apiKey")
    put(provider, "api", "openai-completions", f"{where}.api")
    models = provider.get("models") if isinstance(provider.get("models"), list) else []
    entry = model_entry(s)
    old = next((m for m in models if isinstance(m, dict) and m.get("id") == s.model), None)
    merged = {**(old or {}), **entry}  # the user's extra fields on our model (cost, headers) stay
    if old != merged or not isinstance(provider.get("models"), list):
        changes.append(f"{where}.models[{s.model}]: " + ("updated" if old else "added")
                       + f" (contextWindow {entry['contextWindow']}, maxTokens {entry['maxTokens']})")
        provider["models"] = [merged if m is old else m for m in models] + ([] if old else [merged])

    defaults = _at(new, "agents", "defaults")
    primary = f"{PROVIDER}/{s.model}"
    if isinstance(defaults.get("model"), dict):  # {primary, fallbacks}: the fallbacks stay
        put(defaults["model"], "primary", primary, "agents.defaults.model.primary")
    else:
        put(defaults, "model", {"primary": primary}, "agents.defaults.model")
    if s.context_length < MINIMAL_TOOLS_BELOW:
        put(_at(new, "tools"), "profile", "minimal", "tools.profile")
    return new, changes


def _short(value: Any) -> str:
    text = "(unset)" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_config(path: Path) -> dict[str, Any]:
    """The parsed file ({} when it does not exist yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise OpenClawConfigError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        return {}
    try:
        parsed = json5.loads(text)
    except ValueError as exc:
        raise OpenClawConfigError(f"{path} is not valid JSON5: {str(exc).splitlines()[0]}") from None
    if not isinstance(parsed, dict):
        raise OpenClawConfigError(f"{path} must hold a JSON5 object, not {type(parsed).__name__}")
    return parsed


def write_config(path: Path, config: dict[str, Any]) -> Path | None:
    """Write `config` atomically (mode 0600: it holds API keys); the previous file is kept as
    `<name>.bak-<UTC time>` first. Returns the backup's path (None for a new file)."""
    backup = None
    if path.exists():
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        backup = path.with_name(f"{path.name}.bak-{stamp}")
        shutil.copy2(path, backup)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return backup


def connect(path: Path, s: Served) -> tuple[list[str], Path | None]:
    """Merge the provider into the file at `path`: (changes, backup). Nothing is written when
    nothing changes; an unreadable file raises `OpenClawConfigError` and is left untouched."""
    new, changes = merge(read_config(path), s)
    return changes, (write_config(path, new) if changes else None)
