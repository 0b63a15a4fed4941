"""Eval gate: a candidate checkpoint reaches users only if it is not worse than the champion.

Checks, cheapest first:
1. every weight is finite (a NaN/inf checkpoint is rejected without loading a model);
2. drift on fixed probe prompts: the champion's greedy reply to each probe is scored under both
   models; the mean per-token KL(champion ‖ candidate) over those positions must stay under
   `gate.max_kl`, and the candidate's NLL of those replies may not rise by more than
   `gate.max_nll_increase` nats/token. Training on a few turns should nudge the policy, not
   rewrite how it answers unrelated prompts; a degraded or diverged checkpoint fails here.

Simplification: no fresh-reply judging (a fresh reply has no next state to judge); the probe
set is fixed prompts from config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from clawflow.config import GateConfig


@dataclass
class GateResult:
    passed: bool
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)


def nonfinite_tensors(model_dir: str | Path) -> list[str]:
    """Names of tensors holding NaN or inf in the checkpoint's safetensors files."""
    import torch
    from safetensors import safe_open

    bad = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not torch.isfinite(f.get_tensor(name)).all():
                    bad.append(name)
    return bad


def probe_drift(champion_dir: str, candidate_dir: str, prompts: list[str], max_new_tokens: int) -> dict[str, float]:
    """Mean per-token KL(champion ‖ candidate) and NLL change on the champion's greedy replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(champion_dir)
    champ = AutoModelForCausalLM.from_pretrained(champion_dir, dtype=torch.float32).eval()
    cand = AutoModelForCausalLM.from_pretrained(candidate_dir, dtype=torch.float32).eval()
    kls, nll_deltas = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            full = champ.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
            n = full.shape[1] - ids.shape[1]
            if n == 0:
                continue
            lp_c = torch.log_softmax(champ(full).logits[0, -n - 1 : -1].float(), -1)  # [n, V]
            lp_k = torch.log_softmax(cand(full).logits[0, -n - 1 : -1].float(), -1)
            kls.append(float((lp_c.exp() * (lp_c - lp_k)).sum(-1).mean()))
            target = full[0, -n:, None]
            nll_deltas.append(float((lp_c.gather(-1, target) - lp_k.gather(-1, target)).mean()))
    if not kls:
        return {"probe_kl": 0.0, "probe_nll_increase": 0.0, "probes": 0.0}
    return {"probe_kl": sum(kls) / len(kls), "probe_nll_increase": sum(nll_deltas) / len(nll_deltas),
            "probes": float(len(kls))}


def evaluate(gate: GateConfig, candidate_dir: str, champion_dir: str) -> GateResult:
    if bad := nonfinite_tensors(candidate_dir):
        return GateResult(False, f"non-finite weights in {len(bad)} tensors (e.g. {bad[0]})",
                          {"nonfinite_tensors": float(len(bad))})
    if not gate.enabled:
        return GateResult(True, "gate disabled: finite weights only", {"nonfinite_tensors": 0.0})
    m = probe_drift(champion_dir, candidate_dir, gate.probes, gate.max_new_tokens)
    m["nonfinite_tensors"] = 0.0
    if not math.isfinite(m["probe_kl"]) or m["probe_kl"] > gate.max_kl:
        return GateResult(False, f"probe KL {m['probe_kl']:.4f} > max_kl {gate.max_kl}", m)
    if m["probe_nll_increase"] > gate.max_nll_increase:
        return GateResult(False, f"probe NLL rose {m['probe_nll_increase']:.4f} nats/token "
                                 f"> {gate.max_nll_increase}", m)
    return GateResult(True, f"probe KL {m['probe_kl']:.4f} ≤ {gate.max_kl}", m)
