"""Terminal tasks: the policy solves small shell tasks with a `run_shell` tool in a sandbox.

Each episode copies a task's files into a fresh sandbox (sandbox.py); every `run_shell` call
runs there and its output is the next state (a `tool` message). The episode ends when the policy
replies without a tool call (its final answer) or runs out of turns; the task's checks (files
with the right content, the right number in the answer) give the outcome reward, 1.0 or 0.0.
Tasks live in configs/envs/terminal_tasks.yaml, each with a reference `solution` that the tests
run to prove the task is solvable and its check is not already satisfied at the start.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from clawflow.config import REPO_ROOT, EnvConfig
from clawflow.envs.base import Environment, Episode, Step
from clawflow.envs.sandbox import Sandbox

DEFAULT_FILE = REPO_ROOT / "configs" / "envs" / "terminal_tasks.yaml"

SYSTEM = ("You are working in a sandbox directory on a Linux machine. Use the run_shell tool to run bash "
          "commands there (relative paths only; no network). When the task is done, reply with a short "
          "final answer and no tool call.")
RUN_SHELL = {"type": "function", "function": {
    "name": "run_shell",
    "description": "Run a bash command in the task's sandbox directory; returns its output and exit code.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}}


def _read(box: Sandbox, rel: str) -> str | None:
    path = (box.dir / rel).resolve()
    if not path.is_relative_to(box.dir) or not path.is_file():
        return None
    return path.read_text(errors="replace")


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _answer(answer: str, spec: dict) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(str(spec['value']))}(?![\w])", answer) is not None


def _executable(box: Sandbox, spec: dict) -> bool:
    path = box.dir / spec["path"]
    if not path.is_file() or not os.access(path, os.X_OK):
        return False
    res = box.run(f"./{spec['path']}")
    return res.exit_code == 0 and _norm(res.output.rsplit("[exit code", 1)[0]) == _norm(spec["output"])


CHECKS: dict[str, Callable[[Sandbox, str, dict], bool]] = {
    "file_equals": lambda box, ans, s: (t := _read(box, s["path"])) is not None and _norm(t) == _norm(s["content"]),
    "file_contains": lambda box, ans, s: s["text"] in (_read(box, s["path"]) or ""),
    "exists": lambda box, ans, s: (box.dir / s["path"]).exists(),
    "absent": lambda box, ans, s: not (box.dir / s["path"]).exists(),
    "answer": lambda box, ans, s: _answer(ans, s),
    "executable_output": lambda box, ans, s: _executable(box, s),
}


@dataclass
class TerminalTask:
    name: str
    prompt: str
    checks: list[dict[str, Any]]
    files: dict[str, str] = field(default_factory=dict)
    solution: str | None = None

    def passed(self, box: Sandbox, answer: str) -> bool:
        return all(CHECKS[c["kind"]](box, answer, c) for c in self.checks)


def load_tasks(path: Path | None = None) -> list[TerminalTask]:
    src = Path(path or DEFAULT_FILE)
    tasks = []
    for t in yaml.safe_load(src.read_text())["tasks"]:
        checks = t["check"] if isinstance(t["check"], list) else [t["check"]]
        for c in checks:
            if c.get("kind") not in CHECKS:
                raise ValueError(f"{src}: task {t['name']}: unknown check `{c.get('kind')}`")
        tasks.append(TerminalTask(t["name"], t["prompt"], checks, t.get("files") or {}, t.get("solution")))
    if len({t.name for t in tasks}) != len(tasks):
        raise ValueError(f"{src}: task names must be unique")
    return tasks


def tool_result(box: Sandbox, call: dict[str, Any]) -> dict[str, Any]:
    """The `tool` message answering one tool call."""
    fn = call.get("function") or {}
    if fn.get("name") != "run_shell":
        content = f"error: unknown tool `{fn.get('name')}`; the only tool is run_shell"
    else:
        try:
            args = json.loads(fn.get("arguments") or "{}")
            command = args["command"]
            if not isinstance(command, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            content = 'error: arguments must be JSON like {"command": "ls"}'
        else:
            content = box.run(command).render()
    return {"role": "tool", "tool_call_id": call.get("id"), "content": content}


class TerminalEnv(Environment):
    name = "terminal"

    def __init__(self, tasks: list[TerminalTask], cfg: EnvConfig):
        if not tasks:
            raise ValueError("no terminal tasks")
        self.tasks = tasks
        self.cfg = cfg

    def start(self, rng: random.Random) -> Episode:
        task = rng.choice(self.tasks)
        box = Sandbox(self.cfg.command_timeout_s, self.cfg.output_cap_bytes)
        box.write(task.files)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
        return Episode(messages, tools=[RUN_SHELL], data={"task": task, "box": box, "answer": None})

    def step(self, episode: Episode, reply: dict, rng: random.Random) -> Step:
        calls = reply.get("tool_calls") or []
        if not calls:
            episode.data["answer"] = reply.get("content") or ""
            return Step([], done=True)
        return Step([tool_result(episode.data["box"], c) for c in calls])

    def outcome(self, episode: Episode) -> float | None:
        task: TerminalTask = episode.data["task"]
        return 1.0 if task.passed(episode.data["box"], episode.data["answer"] or "") else 0.0

    def close(self, episode: Episode) -> None:
        episode.data["box"].close()
