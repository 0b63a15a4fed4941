"""Which OPD teacher: the live policy or the frozen base? A small experiment on SmolLM2-135M.

In continual training the served policy drifts from the base after the first version. With the
frozen base as teacher the OPD advantage is

    log base(a | x+h) - log policy(a | x)  =  [log policy(a | x+h) - log policy(a | x)]   (the hint)
                                            + [log base(a | x+h)  - log policy(a | x+h)] (the drift)

so it also pulls the policy back toward the base, whatever the hint says. The experiment:
1. drift: train v1 from the base with binary RL on 4 turns scored +1 (clawflow's trainer);
2. sample hinted turns from v1, and decompose both teachers' advantages token by token, with
   real hints and with a content-free control hint ("Thanks.");
3. OPD-train v1 on the hinted turns with each teacher; measure how much of the RL gain survives
   and how far the student (without hint) moved toward v1-with-hint.

    CLAWFLOW_HOME=/work/main/.clawflow .venv/bin/python bench/opd_teacher.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow.base_model import base_model_dir
from clawflow.config import REPO_ROOT, load_config
from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.policy.logprobs import response_logprobs
from clawflow.train.launch import run_training
from clawflow.train.teacher import hinted_messages

RL_TURNS = ["Write a haiku about the sea.", "What is 12 times 12?", "Name a famous painter.", "Describe a sunset."]
HINT_TURNS = [("What is the capital of France?", "Answer in one word."),
              ("Give me a tip for sleeping better.", "Answer in French."),
              ("How do I reverse a list in Python?", "Show only the code, no explanation."),
              ("Tell me a joke.", "Make it about cats."),
              ("What's a good name for a dog?", "Suggest exactly three names as a numbered list."),
              ("Explain photosynthesis.", "Keep it under 20 words.")]
NULL_HINT = "Thanks."
NEW_TOKENS = 24
CPU = torch.device("cpu")


def encode(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def sample(model, prompt: list[int], seed: int) -> list[int]:
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_p=1.0,
                         max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def lps(model, prompts, responses) -> list[torch.Tensor]:
    with torch.no_grad():
        lp = response_logprobs(model, prompts, responses, 0, CPU)
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def train(tmp: Path, name: str, start: Path, rows: list[dict], frozen_base: str, **train_cfg) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), tmp / f"{name}.parquet")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    raw["train"] = {"micro_batch": 6, "resume_every": 0, "keep_optimizer": False, **train_cfg}
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / f"{name}.yaml")
    m = run_training(tmp / f"{name}.yaml", cfg, start, tmp / f"{name}.parquet", tmp / name, frozen_base=frozen_base)
    print(f"  trained {name}: {m['steps']} steps, last loss {m['per_step'][-1]['loss']:.4f}", flush=True)
    return tmp / name


def row(prompt, response, logprobs, reward, hint=None, messages=None) -> dict:
    return {"turn_id": None, "prompt_token_ids": prompt, "response_token_ids": response,
            "response_logprobs": logprobs, "reward": reward, "hint": hint,
            "messages": json.dumps(messages) if messages else None, "tools": None, "group_id": None,
            "policy_version": 1}


def cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(xs)


def main() -> None:
    base_dir = base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = load(base_dir)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # 1. drift: v1 = base + binary RL on 4 turns scored +1
        rl_prompts = [encode(tok, [{"role": "user", "content": t}]) for t in RL_TURNS]
        rl_resp = [sample(base, p, i) for i, p in enumerate(rl_prompts)]
        rl_lp0 = lps(base, rl_prompts, rl_resp)
        v1_dir = train(tmp, "v1", Path(base_dir), [row(p, r, lp.tolist(), 1.0) for p, r, lp in
                                                   zip(rl_prompts, rl_resp, rl_lp0)], base_dir,
                       objective="rl", lr=2e-5, epochs=4)
        v1 = load(v1_dir)
        rl_gain_v1 = float(cat(lps(v1, rl_prompts, rl_resp)).sum() - cat(rl_lp0).sum())

        # 2. hinted turns sampled from v1; both teachers' advantages, token by token
        msgs = [[{"role": "user", "content": q}] for q, _ in HINT_TURNS]
        x = [encode(tok, m) for m in msgs]
        resp = [sample(v1, p, 100 + i) for i, p in enumerate(x)]
        old = cat(lps(v1, x, resp))
        print(f"\nv1 drift from the base: RL turns' logprob sum +{rl_gain_v1:.2f} nats", flush=True)
        print(f"{'hint':12s} {'|A live|':>9s} {'|A base|':>9s} {'|drift|':>8s} {'corr(A base, drift)':>20s}")
        for label, hints in (("real hints", [h for _, h in HINT_TURNS]), ("'Thanks.'", [NULL_HINT] * len(x))):
            xh = [encode(tok, hinted_messages(m, h)) for m, h in zip(msgs, hints)]
            live, frozen = cat(lps(v1, xh, resp)) - old, cat(lps(base, xh, resp)) - old
            drift = frozen - live
            corr = float(torch.corrcoef(torch.stack([frozen, drift]))[0, 1])
            print(f"{label:12s} {live.abs().mean():9.3f} {frozen.abs().mean():9.3f} {drift.abs().mean():8.3f} "
                  f"{corr:20.2f}", flush=True)

        # 3. OPD from v1 with each teacher
        xh = [encode(tok, hinted_messages(m, h)) for m, (_, h) in zip(msgs, HINT_TURNS)]
        target = cat(lps(v1, xh, resp))  # v1 with the hint: what the hint asks of this policy
        opd_rows = [row(p, r, lp.tolist(), 0.0, h, m) for p, r, lp, m, (_, h) in
                    zip(x, resp, lps(v1, x, resp), msgs, HINT_TURNS)]
        before = float((target - old).abs().mean())
        print(f"\n{'teacher':8s} {'RL gain kept':>13s} {'gap to v1+hint':>15s} (before: {before:.3f})")
        for teacher in ("policy", "base"):
            out = load(train(tmp, f"opd-{teacher}", v1_dir, opd_rows, base_dir, objective="opd", teacher=teacher,
                             lr=1e-5, epochs=3))
            kept = float(cat(lps(out, rl_prompts, rl_resp)).sum() - cat(rl_lp0).sum()) / rl_gain_v1
            gap = float((target - cat(lps(out, x, resp))).abs().mean())
            print(f"{teacher:8s} {kept:13.0%} {gap:15.3f}", flush=True)


if __name__ == "__main__":
    main()
