"""Measuring a policy version against a persona, for the learning benchmark (bench/learning.py).

Three numbers per version, all on data never used for training (configs/envs/learning_bench.yaml):
  * hit-rate: the share of fresh prompts whose greedy reply satisfies every preference of the
    persona (the same pure check the persona uses, so it is exact);
  * judge score: the mean score the configured judge gives those replies when the persona's
    feedback on them is the next state (what training would have seen);
  * reference NLL: mean negative log-likelihood per token of plain reference answers to general
    questions, under the version's weights: general quality, lower is better; a policy that
    learned the preference by forgetting how to answer shows up here.
Replies come from the served gateway as side turns (`X-Turn-Type: side`: never trained on).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from clawflow.config import REPO_ROOT
from clawflow.envs.personas import Persona, Wording, feedback
from clawflow.judge import Judge, JudgeInput, judge_many

DEFAULT_FILE = REPO_ROOT / "configs" / "envs" / "learning_bench.yaml"


@dataclass
class HeldOut:
    eval_prompts: list[str]
    references: list[tuple[str, str]]  # (prompt, reference answer)


def load_held_out(path: Path | None = None, training_prompts: list[str] | None = None) -> HeldOut:
    """The held-out file; ValueError when an eval prompt is also a training prompt."""
    src = Path(path or DEFAULT_FILE)
    raw = yaml.safe_load(src.read_text())
    prompts = list(raw["eval_prompts"])
    if overlap := set(prompts) & set(training_prompts or []):
        raise ValueError(f"{src}: eval prompts also used for training: {sorted(overlap)[:3]}")
    return HeldOut(prompts, [(r["prompt"], r["answer"]) for r in raw["references"]])


def hit_rate(persona: Persona, replies: list[str]) -> float:
    return sum(persona.hit(r) for r in replies) / len(replies) if replies else 0.0


async def _ask(base_url: str, api_key: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=3, timeout=600) as client:
        async def one(p: str) -> str:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0.0,
                extra_headers={"X-Turn-Type": "side", "X-Clawflow-Source": "learning-eval"})
            return r.choices[0].message.content or ""

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def served_replies(base_url: str, api_key: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy replies of the served policy, all prompts in flight at once (one decoding batch)."""
    return asyncio.run(_ask(base_url, api_key, model, prompts, max_tokens))


def judge_score(judge: Judge, persona: Persona, wording: Wording, prompts: list[str], replies: list[str],
                seed: int = 0, concrete_p: float = 0.5) -> float:
    """Mean judge score of the replies, each with the persona's feedback as its next state."""
    rng = random.Random(seed)
    items = [JudgeInput(context=[{"role": "user", "content": p}], turn={"role": "assistant", "content": r},
                        next_state=[{"role": "user", "content": feedback(persona, wording, r, rng, concrete_p).text}],
                        next_role="user") for p, r in zip(prompts, replies)]
    judgments = asyncio.run(judge_many(judge, items, 8))
    scores = [j.score for j in judgments if j is not None]
    return sum(scores) / len(scores) if scores else 0.0


def reference_nll(model_dir: str | Path, references: list[tuple[str, str]], threads: int | None = None) -> float:
    """Mean NLL per token (nats) of the reference answers given their prompts (chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for prompt, answer in references:
            ids = _ids(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
            full = _ids(tok, [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
            if full[: len(ids)] != ids:
                raise ValueError("the chat template does not extend the prompt with the answer")
            x = torch.tensor([full])
            logp = torch.log_softmax(model(x).logits[0, len(ids) - 1 : -1].float(), -1)  # [n, V]
            target = x[0, len(ids):, None]
            total += float(-logp.gather(-1, target).sum())
            count += target.shape[0]
    del model
    return total / max(count, 1)


def _ids(tok: Any, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])
