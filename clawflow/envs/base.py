"""The environment interface and the episode runner.

An environment plays the other side of a conversation: it opens an episode (the first messages
and any tools), and after each assistant reply supplies the next state (a user reply, tool
results) until the episode ends, then optionally an outcome reward. The runner drives episodes
through the gateway with the `openai` SDK exactly like an external client: `X-Session-Id` per
episode, `X-Clawflow-Source` = the environment's name (the recorded `source`), `X-Session-Done`
on the last allowed turn. So the gateway records the turns and the catalog pairs each with its
next state with no special path for environments.

Outcome rewards travel beside the turns, not through the gateway: the episode's outcome is known
only after its last reply is recorded, so the runner appends rows (session_id, turn_index,
response_text, env_reward, source) to `env_rewards/*.parquet` of the storage root (the contract in
clawflow/contracts/env_reward.py), like the judge's judgments; the catalog can join them by
(session_id, turn_index[, response_text]).

Groups (GRPO): with `group_n` > 1 the first turn asks for n choices; the gateway records all n
with one group_id, the episode continues with choice 0, and each choice that the environment
can score on its own (`score`) gets its own env_reward row, matched by its text.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from clawflow.config import EnvConfig


@dataclass
class Episode:
    """One episode's state: the conversation so far plus whatever the environment keeps."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    """What the environment answers to a reply: the next state, and whether the episode ended."""

    messages: list[dict[str, Any]]
    done: bool = False


class Environment(ABC):
    name: str

    @abstractmethod
    def start(self, rng: random.Random) -> Episode:
        """A new episode: its opening messages (and tools)."""

    @abstractmethod
    def step(self, episode: Episode, reply: dict[str, Any], rng: random.Random) -> Step:
        """The next state after the assistant `reply` (already appended to episode.messages)."""

    def outcome(self, episode: Episode) -> float | None:
        """The episode's outcome reward (on its last turn), or None for none."""
        return None

    def score(self, episode: Episode, reply: dict[str, Any]) -> float | None:
        """A reward for one reply on its own (group members), or None when there is none."""
        return None

    def close(self, episode: Episode) -> None:
        """Free what the episode holds (a sandbox directory)."""


@dataclass
class EpisodeResult:
    env: str
    session_id: str
    turns: int = 0
    next_states: int = 0
    outcome: float | None = None
    error: str | None = None
    scores: list[float] = field(default_factory=list)  # env.score of each reply served, in order
    rewards: list[dict[str, Any]] = field(default_factory=list)  # env_reward rows


def _message(choice: Any) -> dict[str, Any]:
    msg = choice.message
    out: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in msg.tool_calls]
    return out


async def run_episode(client: Any, env: Environment, cfg: EnvConfig, model: str,
                      rng: random.Random) -> EpisodeResult:
    """Drive one episode through the gateway; errors end it and are reported, not raised."""
    session = f"{env.name}-{uuid.uuid4().hex}"
    result = EpisodeResult(env=env.name, session_id=session)
    episode = env.start(rng)
    final_index = None
    try:
        for t in range(cfg.max_turns):
            last = t == cfg.max_turns - 1
            headers = {"X-Session-Id": session, "X-Turn-Type": "main", "X-Clawflow-Source": env.name}
            if last:
                headers["X-Session-Done"] = "true"
            n = cfg.group_n if t == 0 else 1
            extra = {"tools": episode.tools} if episode.tools else {}
            # the request's seed comes from the episode's: a seeded round samples the same replies again
            resp = await client.chat.completions.create(
                model=model, messages=episode.messages, n=n, max_tokens=cfg.max_tokens,
                temperature=cfg.temperature, seed=rng.randrange(2**31), extra_headers=headers, **extra)
            turn_index = sum(1 for m in episode.messages if m.get("role") == "assistant")
            replies = [_message(c) for c in sorted(resp.choices, key=lambda c: c.index)]
            if n > 1:
                for r in replies:
                    if (s := env.score(episode, r)) is not None:
                        result.rewards.append(_reward_row(env, session, turn_index, r, s))
            reply = replies[0]
            if (s := env.score(episode, reply)) is not None:
                result.scores.append(s)
            episode.messages.append(reply)
            result.turns += 1
            final_index, final_reply = turn_index, reply
            step = env.step(episode, reply, rng)
            if step.done or last:
                break
            episode.messages.extend(step.messages)
            result.next_states += 1
        result.outcome = env.outcome(episode)
        if result.outcome is not None and final_index is not None:
            result.rewards.append(_reward_row(env, session, final_index, final_reply, result.outcome))
    except Exception as exc:  # a down gateway or a bad reply ends this episode only
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        env.close(episode)
    return result


def _reward_row(env: Environment, session: str, turn_index: int, reply: dict, reward: float) -> dict[str, Any]:
    return {"session_id": session, "turn_index": turn_index, "response_text": reply.get("content") or "",
            "env_reward": float(reward), "source": env.name}


async def run_episodes(envs: list[Environment], cfg: EnvConfig, base_url: str, api_key: str, model: str,
                       count: int, rng: random.Random) -> list[EpisodeResult]:
    """`count` episodes over `envs` (round robin), at most `cfg.concurrency` in flight."""
    from openai import AsyncOpenAI

    if not envs:
        raise ValueError("no environments configured (envs.environments is empty)")
    gate = asyncio.Semaphore(cfg.concurrency)
    seeds = [rng.randrange(2**32) for _ in range(count)]

    async def one(i: int) -> EpisodeResult:
        async with gate:
            return await run_episode(client, envs[i % len(envs)], cfg, model, random.Random(seeds[i]))

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=3,
                           timeout=cfg.request_timeout_s) as client:
        return list(await asyncio.gather(*(one(i) for i in range(count))))


def summarize(results: list[EpisodeResult]) -> dict[str, dict[str, Any]]:
    """Per environment: episodes, failed, turns, next states, mean outcome."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        s = out.setdefault(r.env, {"episodes": 0, "failed": 0, "turns": 0, "next_states": 0, "outcomes": []})
        s["episodes"] += 1
        s["failed"] += r.error is not None
        s["turns"] += r.turns
        s["next_states"] += r.next_states
        if r.outcome is not None:
            s["outcomes"].append(r.outcome)
    for s in out.values():
        outcomes = s.pop("outcomes")
        s["mean_outcome"] = sum(outcomes) / len(outcomes) if outcomes else None
    return out


def pace_s(episodes: int, elapsed_s: float, per_minute: float) -> float:
    """Seconds to wait after `episodes` took `elapsed_s` so the rate stays at `per_minute`."""
    return max(0.0, episodes * 60.0 / per_minute - elapsed_s)
