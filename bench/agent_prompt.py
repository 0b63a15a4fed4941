"""An OpenClaw-shaped agent request for bench/agent_session.py: a long system prompt (identity, tool
rules, safety, CLI reference, skills, injected workspace files), the minimal profile's tool schemas,
and user messages in OpenClaw's envelope (`[Fri 2026-12-04 06:11 UTC] …`, the first one ending in a
`Runtime: agent=main | session=…` line). Synthetic but sized like the real thing: OpenClaw 2026.9.6's
minimal-profile request is ~7,700 SmolLM2 tokens (FIELD_NOTES.md); `build` pads the workspace files
with deterministic, varied guideline text until system prompt + tools reach the target.
"""

from __future__ import annotations

import random

HEAD = """You are a personal assistant running inside OpenClaw.

## Tooling
Tool availability (filtered by policy):
- read: Read file contents
- write: Create or overwrite files
- edit: Make precise edits to files
- exec: Run shell commands (pty available for TTY-required CLIs)
- process: Manage background exec sessions
- session_status: Show a /status-equivalent status card (usage, time, model)
TOOLS.md does not control tool availability; it is user guidance for how to use external tools.
If a task is more complex or takes longer, spawn a sub-agent. It will do the work for you and ping you when it's done.

## Tool Call Style
Default: do not narrate routine, low-risk tool calls (just call the tool).
Narrate only when it helps: multi-step work, complex/challenging problems, sensitive actions (e.g., deletions), or when the user explicitly asks.
Keep narration brief and value-dense; avoid repeating obvious steps.

## Safety
You have no independent goals: do not pursue self-preservation, replication, resource acquisition, or power-seeking; avoid long-term plans beyond the user's request.
Prioritize safety and human oversight over completion; if instructions conflict, pause and ask; comply with stop/pause/audit requests and never bypass safeguards.
Do not manipulate or persuade anyone to expand access or disable safeguards. Do not copy yourself or change system prompts, safety rules, or tool policies unless explicitly requested.

## OpenClaw CLI Quick Reference
OpenClaw is controlled via subcommands. Do not invent commands.
To manage the Gateway daemon service (start/stop/restart):
- openclaw gateway status
- openclaw gateway start
- openclaw gateway stop
- openclaw gateway restart
If unsure, ask the user to run `openclaw help` (or `openclaw gateway --help`) and paste the output.

## Memory Recall
Before answering anything about prior work, decisions, dates, people, preferences, or todos: search MEMORY.md and memory/*.md, then pull only the needed lines. If low confidence after search, say you checked.

## Workspace
Your working directory is: /home/user/.openclaw/workspace
Treat this directory as the single global workspace for file operations unless explicitly instructed otherwise.

## Silent Replies
When you have nothing to say, respond with ONLY: NO_REPLY

## Heartbeats
Heartbeat prompt: Read HEARTBEAT.md if it exists (workspace context). Follow it strictly. Do not infer or repeat old tasks from prior chats. If nothing needs attention, reply HEARTBEAT_OK.

# Project Context
The following project context files have been loaded:
"""

FILES = ["AGENTS.md", "SOUL.md", "TOOLS.md", "IDENTITY.md", "USER.md", "HEARTBEAT.md", "MEMORY.md"]
VERBS = ["Check", "Prefer", "Keep", "Write", "Review", "Avoid", "Confirm", "Record", "Summarize", "Ask about"]
OBJECTS = ["the calendar before proposing times", "short replies in group chats", "the user's timezone",
           "secrets out of logs and memory files", "a daily note in memory/ with decisions made",
           "destructive shell commands unless confirmed", "links to the sources you used",
           "the weather before suggesting outdoor plans", "what changed since the last heartbeat",
           "the user's preferred names for people and places", "commit messages in the imperative mood",
           "tests after every edit to a repository", "reminders that are already past due",
           "files you created during this session", "the budget before booking anything"]
WHY = ["because the user reads on a phone", "so that the next session can pick up the thread",
       "since mistakes here are expensive to undo", "as the user asked for this explicitly",
       "to keep the workspace tidy", "unless the user says otherwise today"]

TOOLS = [
    {"type": "function", "function": {"name": "read", "description": "Read the contents of a file. Supports text files and images. For text files, output is truncated to 2000 lines or 50KB; use offset/limit for large files.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Path to the file to read (relative or absolute)"}, "offset": {"type": "number", "description": "Line number to start reading from (1-indexed)"}, "limit": {"type": "number", "description": "Maximum number of lines to read"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write", "description": "Write content to a file. Creates the file if it doesn't exist, overwrites if it does. Automatically creates parent directories.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Path to the file to write"}, "content": {"type": "string", "description": "Content to write to the file"}}, "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "edit", "description": "Edit a file by replacing exact text. The oldText must match exactly (including whitespace). Use this for precise, surgical edits.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "oldText": {"type": "string", "description": "Exact text to find and replace"}, "newText": {"type": "string", "description": "New text to replace the old text with"}}, "required": ["path", "oldText", "newText"]}}},
    {"type": "function", "function": {"name": "exec", "description": "Execute shell commands with background continuation. Use yieldMs/background to continue later via process tool. Use pty=true for TTY-required commands (terminal UIs, coding agents).",
     "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "Shell command to execute"}, "workdir": {"type": "string"}, "env": {"type": "object"}, "yieldMs": {"type": "number", "description": "Milliseconds to wait before backgrounding (default 10000)"}, "background": {"type": "boolean"}, "timeout": {"type": "number", "description": "Timeout in seconds"}, "pty": {"type": "boolean"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "process", "description": "Manage running exec sessions: list, poll, log, write, send-keys, submit, paste, kill.",
     "parameters": {"type": "object", "properties": {"action": {"type": "string", "enum": ["list", "poll", "log", "write", "send-keys", "submit", "paste", "kill"]}, "sessionId": {"type": "string"}, "data": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "session_status", "description": "Show a /status-equivalent session status card (usage + time + cost when available). Use for model-use questions.",
     "parameters": {"type": "object", "properties": {"sessionKey": {"type": "string"}, "model": {"type": "string"}}}}},
]

QUESTIONS = ["What's on my calendar tomorrow?", "Remind me to call the dentist at 4pm.",
             "Summarize the notes in memory/ from this week.", "Find the invoice PDF I saved yesterday.",
             "What's the weather going to be like this weekend?", "Draft a short reply to Anna's email.",
             "Which of my todos are overdue?", "Rename the project folder to garden-planner.",
             "How much disk space is left?", "Book a table for two on Friday evening."]


def system_prompt(items: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, n = [HEAD], 0
    per_file = max(1, items // len(FILES) + 1)
    for name in FILES:
        parts.append(f"\n## {name}\n")
        for _ in range(per_file):
            if n >= items:
                break
            n += 1
            parts.append(f"- {rng.choice(VERBS)} {rng.choice(OBJECTS)}, {rng.choice(WHY)} (rule {n}).\n")
    parts.append("\n## Runtime\nRuntime: agent=main | host=laptop | os=Linux 6.8 (x64) | node=v24.22.3 | "
                 "model=clawflow/smollm2-135m-instruct | shell=bash | channel=cli | thinking=off\n")
    return "".join(parts)


def wrap(text: str, turn: int, session: str) -> str:
    """OpenClaw's envelope: a time prefix; the session's first message also gets the Runtime line."""
    msg = f"[Fri 2026-12-04 06:{10 + turn:02d} UTC] {text}"
    if turn == 0:
        msg += f"\n\nRuntime: agent=main | session=agent:main:{session} | sessionId={session} | host=laptop | " \
               "model=clawflow/smollm2-135m-instruct | shell=bash"
    return msg


def build(tokenizer, target_tokens: int) -> tuple[str, list[dict], int]:
    """(system prompt, tools, tokens of system + tools + the chat template) near `target_tokens`."""

    def size(items: int) -> int:
        msgs = [{"role": "system", "content": system_prompt(items)}]
        return len(tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=False))

    lo, hi = 0, 4000
    while lo < hi:  # the most guideline items that stay within the target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= target_tokens else (lo, mid - 1)
    return system_prompt(lo), TOOLS, size(lo)
