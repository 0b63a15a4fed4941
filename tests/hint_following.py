"""A tiny model whose teacher is known to show a preference, for tests that must see learning happen.

The random tiny model follows no instruction, so with it no recipe can learn anything a test could
check. This one is taught in a few seconds of SFT to do what a hint in its prompt asks: without a
hint it answers every prompt with LONG (40 words: `terse` marks it too long), with any hint in the
system message (where distillation's teacher reads the standing preferences, `train.rewrite_hint`)
it answers SHORT, a fixed 7-word reply. (Plain, it answers SHORT one time in five when sampled: the
recipe's RL part has approved short samples to learn from, as a real model's sampled replies vary.)
So the teacher's ceiling is 1.0 and the base's hit-rate 0.0: whatever moves between them is what the
training path carried from the hinted prompt into the plain one, on prompts it never trained on.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from clawflow.train.prompts import load_prompts
from clawflow.train.teacher import system_hinted_messages

LONG = ("Here is a long and careful answer that covers every side of your question in detail, with the "
        "background, several examples, the usual caveats, and a few further notes for you to read when you "
        "have a spare moment later today.")
SHORT = "Short answer: start with the simplest step."
PLAIN_SHORT = 0.2  # how often the plain model answers SHORT (sampled; greedy it answers LONG)
HINTS = ["Please keep replies under 30 words.", "Shorter please: 30 words at most.",
         "Answer in no more than 30 words.", "Be brief.", "Use plain words only.", "Always answer kindly.",
         "Please answer as a bullet list.", "Never use the word certainly."]


def _example(tok, messages: list[dict], reply: str) -> tuple[list[int], list[int]]:
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    answer = tok(reply, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    return list(prompt) + answer, [-100] * len(prompt) + answer


def build(src: str | Path, out: Path, steps: int = 200, seed: int = 0) -> Path:
    """Copy the model at `src` to `out`, taught LONG without a hint and SHORT with one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompts = [p.prompt for p in load_prompts()]  # the broad prompts (configs/train/prompts.yaml)

    def batch() -> list[tuple[list[int], list[int]]]:
        out = []
        for _ in range(8):
            first = [{"role": "user", "content": rng.choice(prompts)}]
            turns = first if rng.random() < 0.6 else \
                first + [{"role": "assistant", "content": rng.choice([LONG, SHORT])},
                         {"role": "user", "content": f"Thanks. Next one: {rng.choice(prompts)}"}]
            if rng.random() < 0.5:
                out.append(_example(tok, turns, SHORT if rng.random() < PLAIN_SHORT else LONG))
            else:
                out.append(_example(tok, system_hinted_messages(turns, rng.choice(HINTS)), SHORT))
        return out

    return _train(model, tok, batch, steps, out)


def answering_short(src: str | Path, out: Path, steps: int = 40, seed: int = 0) -> Path:
    """Copy the model at `src` to `out`, taught to answer every plain prompt SHORT: a student that
    learned what the hinted teacher shows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompts = [p.prompt for p in load_prompts()]
    return _train(model, tok, lambda: [_example(tok, [{"role": "user", "content": rng.choice(prompts)}], SHORT)
                                       for _ in range(8)], steps, out)


def _train(model, tok, make_batch, steps: int, out: Path) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = make_batch()
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tok.pad_token_id or 0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100  # the head only where a reply token is predicted: the logits are most of the cost
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out

