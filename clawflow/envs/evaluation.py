"""Measuring a policy version against a persona, for the learning benchmark (bench/learning.py).

The hit-rate: the share of fresh prompts (configs/envs/learning_bench.yaml, never used to collect
training turns) whose greedy reply satisfies every preference of the persona (the same pure check
the persona uses, so it is exact). General quality is `clawflow.helpfulness` (key facts stated on
held-out questions, degeneracy), the measure the eval gate uses: a reference answer's NLL, used
before, *fell* when a policy became terse, so it rewarded collapse.
Replies come from the served gateway as side turns (`X-Turn-Type: side`: never trained on).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import yaml

from clawflow.config import REPO_ROOT
from clawflow.envs.personas import Persona

DEFAULT_FILE = REPO_ROOT / "configs" / "envs" / "learning_bench.yaml"


@dataclass
class HeldOut:
    eval_prompts: list[str]


def load_held_out(path: Path | None = None, training_prompts: list[str] | None = None,
                  persona: str | None = None) -> HeldOut:
    """The held-out prompts (the persona's own list under `persona_eval_prompts` when it has one,
    e.g. how-to questions for a persona that wants numbered steps); ValueError when an eval prompt
    is also a training prompt."""
    src = Path(path or DEFAULT_FILE)
    raw = yaml.safe_load(src.read_text())
    prompts = list((raw.get("persona_eval_prompts") or {}).get(persona) or raw["eval_prompts"])
    if overlap := set(prompts) & set(training_prompts or []):
        raise ValueError(f"{src}: eval prompts also used for training: {sorted(overlap)[:3]}")
    return HeldOut(prompts)


def hit_rate(persona: Persona, replies: list[str]) -> float:
    return sum(persona.hit(r) for r in replies) / len(replies) if replies else 0.0


MAX_IN_FLIGHT = 32  # serving.max_concurrency's default: one decoding batch


async def _ask(base_url: str, api_key: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    from openai import AsyncOpenAI

    gate = asyncio.Semaphore(MAX_IN_FLIGHT)  # the gateway answers 429 past its queue (217 questions at once did)
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=3, timeout=600) as client:
        async def one(p: str) -> str:
            async with gate:
                return await _one(client, p)

        async def _one(client, p: str) -> str:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0.0,
                extra_headers={"X-Turn-Type": "side", "X-Clawflow-Source": "learning-eval"})
            return r.choices[0].message.content or ""

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def served_replies(base_url: str, api_key: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy replies of the served policy, up to MAX_IN_FLIGHT prompts in flight (one decoding batch)."""
    return asyncio.run(_ask(base_url, api_key, model, prompts, max_tokens))
