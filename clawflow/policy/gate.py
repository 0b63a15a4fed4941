"""Eval gate: a candidate checkpoint reaches users only if it is not worse than the champion.

Checks, cheapest first:
1. every weight is finite (a NaN/inf checkpoint is rejected without loading a model);
2. drift on fixed probe prompts: the champion's greedy reply to each probe is scored under both
   models; the mean per-token KL(champion ‖ candidate) over those positions must stay under
   `gate.max_kl`, and the candidate's NLL of those replies may not rise by more than
   `gate.max_nll_increase` nats/token. Training on a few turns should nudge the policy, not
   rewrite how it answers unrelated prompts; a degraded or diverged checkpoint fails here;
3. held-out judged turns (clawflow/policy/holdout.py picks them: recent, judged, not in the candidate's
   batch): the mean per-token log-likelihood of each recorded reply under both models. On replies
   the judge scored +1 the candidate may not fall below the champion by more than
   `gate.judged_margin` nats/token, on replies scored −1 it may not rise above it by more.
   A policy that learned the opposite of its users' feedback fails here, even with small drift.

4. helpfulness (clawflow/helpfulness.py): greedy answers to held-out general questions must still
   state their key facts (no lower than the champion's and the base's by more than
   `gate.helpfulness.margin`) and must not degenerate (one answer for many questions, loops, empty
   or unrelated answers). A learned preference never excuses a lost answer; generation that fails
   or runs out of time rejects the candidate. The references' figures are cached per checkpoint.

Simplification: no fresh-reply judging (a fresh reply has no next state to judge); judged turns
are scored by likelihood of their recorded reply, which needs no judge at gate time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from clawflow.config import GateConfig, HelpfulnessGateConfig

if TYPE_CHECKING:  # holdout reads the store; the gate only scores what it is handed
    from clawflow.policy.holdout import ProbeTurn

Step = Callable[[], None]


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


def judged_margins(champion_lp: Sequence[float], candidate_lp: Sequence[float],
                   scores: Sequence[int]) -> dict[str, float]:
    """Mean (candidate − champion) per-token log-likelihood over held-out replies judged +1 and −1.

    Pure: inputs are one mean log-likelihood per turn under each model and the judge's score."""
    pos = [k - c for c, k, s in zip(champion_lp, candidate_lp, scores, strict=True) if s > 0]
    neg = [k - c for c, k, s in zip(champion_lp, candidate_lp, scores, strict=True) if s < 0]
    return {"judged_pos": float(len(pos)), "judged_neg": float(len(neg)),
            "judged_pos_delta": sum(pos) / len(pos) if pos else 0.0,
            "judged_neg_delta": sum(neg) / len(neg) if neg else 0.0}


def judged_verdict(m: dict[str, float], margin: float, min_turns: int = 1) -> str | None:
    """Why the candidate is worse on held-out judged turns, or None when it is not. A sign with
    fewer than `min_turns` turns says nothing (one turn's change is mostly noise)."""
    pos, neg = m["judged_pos_delta"], m["judged_neg_delta"]
    if m["judged_pos"] >= min_turns and (not math.isfinite(pos) or pos < -margin):
        return (f"held-out replies judged good became less likely: {pos:+.4f} nats/token over "
                f"{int(m['judged_pos'])} turns (allowed −{margin})")
    if m["judged_neg"] >= min_turns and (not math.isfinite(neg) or neg > margin):
        return (f"held-out replies judged bad became more likely: {neg:+.4f} nats/token over "
                f"{int(m['judged_neg'])} turns (allowed +{margin})")
    return None


def judged_learning(m: dict[str, float], gate: GateConfig) -> bool:
    """With nothing standing to measure: did the candidate move toward the held-out judgments (good
    replies likelier, bad ones less likely, by more than `min_preference_gain` nats/token)? Pure."""
    if m.get("judged_pos", 0) + m.get("judged_neg", 0) < gate.judged_min_turns:
        return False
    return m["judged_pos_delta"] - m["judged_neg_delta"] > gate.min_preference_gain


def load_pair(champion_dir: str, candidate_dir: str):  # tests and benches: both models at once
    """(tokenizer, champion, candidate); a LoRA adapter directory is loaded onto its base, merged."""
    from clawflow.helpfulness import load_model

    champ, tok = load_model(champion_dir)
    cand, _ = load_model(candidate_dir)
    return tok, champ, cand


def champion_replies(tok, champ, prompts: list[str], max_new_tokens: int,
                     step: Step | None = None) -> list[tuple]:
    """The champion's side of `drift`: per probe its greedy reply (prompt + reply ids, reply length)
    and its log-probabilities over the reply; the same for every dose of one candidate."""
    import torch

    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            full = champ.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
            n = full.shape[1] - ids.shape[1]
            if step:
                step()
            if n:
                out.append((full, n, torch.log_softmax(champ(full).logits[0, -n - 1 : -1].float(), -1)))
    return out


def drift(tok, champ, cand, prompts: list[str], max_new_tokens: int, step: Step | None = None,
          replies: list[tuple] | None = None) -> dict[str, float]:
    """Mean per-token KL(champion ‖ candidate) and NLL change on the champion's greedy replies
    (`replies`: `champion_replies`, when already computed)."""
    import torch

    kls, nll_deltas = [], []
    if replies is None:
        replies = champion_replies(tok, champ, prompts, max_new_tokens, step)
    with torch.inference_mode():
        for full, n, lp_c in replies:
            lp_k = torch.log_softmax(cand(full).logits[0, -n - 1 : -1].float(), -1)
            kls.append(float((lp_c.exp() * (lp_c - lp_k)).sum(-1).mean()))
            target = full[0, -n:, None]
            nll_deltas.append(float((lp_c.gather(-1, target) - lp_k.gather(-1, target)).mean()))
    if not kls:
        return {"probe_kl": 0.0, "probe_nll_increase": 0.0, "probes": 0.0}
    return {"probe_kl": sum(kls) / len(kls), "probe_nll_increase": sum(nll_deltas) / len(nll_deltas),
            "probes": float(len(kls))}


def reply_loglik(model, turns: Sequence[ProbeTurn], max_tokens: int, step: Step | None = None) -> list[float]:
    """Mean per-token log-likelihood of each turn's recorded reply given its recorded prompt
    (token ids, no re-tokenization); long prompts keep their last tokens."""
    import torch

    from clawflow.policy.logprobs import response_logprobs

    out = []
    with torch.inference_mode():
        for t in turns:
            reply = list(t.response_token_ids)[:max_tokens]
            prompt = list(t.prompt_token_ids)[-max(max_tokens - len(reply), 1):]
            out.append(float(response_logprobs(model, [prompt], [reply])[0].mean()))
            if step:
                step()
    return out


def judged_probe(tok, champ, cand, turns: Sequence[ProbeTurn], max_tokens: int,
                 step: Step | None = None, champion_lp: list[float] | None = None) -> dict[str, float]:
    turns = scorable(turns)
    if champion_lp is None:
        champion_lp = reply_loglik(champ, turns, max_tokens, step)
    return judged_margins(champion_lp, reply_loglik(cand, turns, max_tokens, step), [int(t.score) for t in turns])


def scorable(turns: Sequence[ProbeTurn] | None) -> list[ProbeTurn]:
    return [t for t in turns or [] if len(t.response_token_ids) > 0 and len(t.prompt_token_ids) > 0]


def helpfulness_check(h: HelpfulnessGateConfig, tok, champ, cand, candidate_dir: str, champion_dir: str,
                      base_dir: str | None, cache_dir: Path | None) -> tuple[str | None, dict[str, float]]:
    """(why the candidate answers worse or degenerates, or None; its figures and the references').
    Each model measured gets the full `timeout_s`; the references come from `cache_dir` when there."""
    from clawflow import helpfulness as H
    from clawflow.judge.minilm import MiniLM

    questions = H.load_questions(h.questions)
    encoder = MiniLM(threads=1)

    def run(model_dir: str, model=None) -> H.Helpfulness:
        return H.measure(model_dir, questions, h.max_new_tokens, time.monotonic() + h.timeout_s, h.threads,
                         cache_dir=cache_dir, offtopic_threshold=h.offtopic_below, model=model,
                         tokenizer=tok if model is not None else None, encoder=encoder)

    candidate = run(candidate_dir, cand)
    refs: dict[str, H.Helpfulness] = {}
    if "champion" in h.compare_to:
        refs["champion"] = run(champion_dir, champ)
    if "base" in h.compare_to and base_dir:
        same = "champion" in refs and Path(base_dir).resolve() == Path(champion_dir).resolve()
        refs["base"] = refs["champion"] if same else run(base_dir)  # loaded only when not cached
    m = candidate.as_metrics("help_")
    for name, ref in refs.items():
        m[f"help_facts_rate_{name}"] = ref.facts_rate
        m[f"help_lost_vs_{name}"], m[f"help_gained_vs_{name}"] = map(float, H.paired(candidate, ref))
        m[f"help_duplicate_share_{name}"] = ref.duplicate_share
        m[f"help_offtopic_share_{name}"] = ref.offtopic_share
    return H.verdict(candidate, refs, h), m


class Champion:
    """The champion's side of the gate, loaded and computed once for every dose of a candidate."""

    def __init__(self, champion_dir: str):
        from clawflow.helpfulness import load_model

        self.dir = champion_dir
        self.model, self.tok = load_model(champion_dir)
        self.replies: list[tuple] | None = None  # drift: the champion's probe replies
        self.judged: list[float] | None = None  # the champion's log-likelihood of the held-out turns


def evaluate(gate: GateConfig, candidate_dir: str, champion_dir: str,
             judged: Sequence[ProbeTurn] | None = None, base_dir: str | None = None,
             cache_dir: Path | None = None, champion: Champion | None = None, candidate=None) -> GateResult:
    """The verdict on `candidate_dir` vs `champion_dir`; `judged` are held-out judged turns
    (policy/holdout.py), empty or None to skip that check; `base_dir`
    is the base model the helpfulness check also compares with; `cache_dir` keeps the references'
    helpfulness figures; `champion`, when given, keeps the champion's side between calls; `candidate`,
    the candidate's model when already loaded. The seconds each check took are in the figures (`seconds_*`)."""
    if bad := nonfinite_tensors(candidate_dir):
        return GateResult(False, f"non-finite weights in {len(bad)} tensors (e.g. {bad[0]})",
                          {"nonfinite_tensors": float(len(bad))})
    if not gate.enabled:
        return GateResult(True, "gate disabled: finite weights only", {"nonfinite_tensors": 0.0})
    from clawflow.helpfulness import load_model

    t0 = time.monotonic()
    champion = champion or Champion(champion_dir)
    tok, champ = champion.tok, champion.model
    cand = candidate if candidate is not None else load_model(candidate_dir)[0]
    t1 = time.monotonic()
    if champion.replies is None:
        champion.replies = champion_replies(tok, champ, gate.probes, gate.max_new_tokens)
    m = drift(tok, champ, cand, gate.probes, gate.max_new_tokens, replies=champion.replies)
    m["nonfinite_tensors"] = 0.0
    t2 = time.monotonic()
    turns = scorable(judged)
    if champion.judged is None:
        champion.judged = reply_loglik(champ, turns, gate.max_probe_tokens)
    m.update(judged_probe(tok, champ, cand, turns, gate.max_probe_tokens, champion_lp=champion.judged))
    m.update(seconds_load=t1 - t0, seconds_drift=t2 - t1, seconds_judged=time.monotonic() - t2)
    if not math.isfinite(m["probe_kl"]) or m["probe_kl"] > gate.max_kl:
        return GateResult(False, f"probe KL {m['probe_kl']:.4f} > max_kl {gate.max_kl}", m)
    if m["probe_nll_increase"] > gate.max_nll_increase:
        return GateResult(False, f"probe NLL rose {m['probe_nll_increase']:.4f} nats/token "
                                 f"> {gate.max_nll_increase}", m)
    if reason := judged_verdict(m, gate.judged_margin, gate.judged_min_turns):
        return GateResult(False, reason, m)
    helped = ""
    if gate.helpfulness.enabled:
        t0 = time.monotonic()
        try:
            reason, figures = helpfulness_check(gate.helpfulness, tok, champ, cand, candidate_dir, champion_dir,
                                                 base_dir, cache_dir)
        except Exception as exc:  # noqa: BLE001 - out of memory, time limit, a bad file: never promote on it
            return GateResult(False, f"helpfulness check failed ({type(exc).__name__}: {exc})", m)
        m.update(figures)
        m["help_seconds"] = time.monotonic() - t0
        if reason:
            return GateResult(False, reason, m)
        helped = f"; key facts {m['help_facts_rate']:.3f} (" + ", ".join(
            f"{n} {figures[f'help_facts_rate_{n}']:.3f}: {figures[f'help_lost_vs_{n}']:.0f} lost, "
            f"{figures[f'help_gained_vs_{n}']:.0f} gained" for n in ("champion", "base")
            if f"help_facts_rate_{n}" in figures) + ")"
    held = int(m["judged_pos"] + m["judged_neg"])
    return GateResult(True, f"probe KL {m['probe_kl']:.4f} ≤ {gate.max_kl}; "
                            f"{held} held-out judged turns within ±{gate.judged_margin}{helped}", m)


WEAK, FAILED = "weak", "failed"  # a dose's outcome: learned too little to measure; failed another check


def next_dose(grid: Sequence[float], tried: Sequence[tuple[float, str]], refinements: int) -> float | None:
    """The dose the gate measures next, or None when the search is over (a dose that passed ends it
    before this is asked). The grid is walked strongest first until a dose is WEAK: a weaker one
    moves the preference less, so the rest of the grid cannot pass. Between the strongest WEAK dose
    and the weakest dose above it that FAILED another check (facts, drift), up to `refinements`
    bisections follow: the preference measure and the facts both move about linearly with the dose
    (terse v4: +0.171, +0.134, +0.091, +0.045 at 1, 0.75, 0.5, 0.25), so a dose between a grid
    point that cost too many facts and one that moved too little can pass both. Pure."""
    done = {d for d, _ in tried}
    weak = [d for d, outcome in tried if outcome == WEAK]
    if not weak:
        rest = [d for d in grid if d not in done]
        return rest[0] if rest else None
    lo = max(weak)
    failed_above = [d for d, outcome in tried if outcome == FAILED and d > lo]
    if not failed_above or sum(d not in grid for d in done) >= refinements:
        return None
    return round((min(failed_above) + lo) / 2, 6)


@dataclass
class DoseVerdict:
    """The gate's verdict over doses: the strongest that passed (None: rejected at every dose tried),
    the checkpoint to register (that dose's, or the undiluted candidate when rejected), the chosen
    (or strongest) dose's figures, and every measured dose's figures."""

    passed: bool
    reason: str
    dose: float | None
    checkpoint: str
    metrics: dict[str, float]
    per_dose: dict[float, dict[str, float]]


def evaluate_doses(gate: GateConfig, candidate_dir: str, champion_dir: str, work_dir: Path,
                   judged: Sequence[ProbeTurn] | None = None, base_dir: str | None = None,
                   cache_dir: Path | None = None, taught: str = "") -> DoseVerdict:
    """`evaluate` at each of `gate.doses`, strongest first (policy/dose.py), stopping at the first that
    passes. With standing preferences (`taught`, what the teacher read), a dose must also make the
    teacher's answers to held-out prompts likelier than the champion does by more than
    `gate.min_preference_gain` (policy/preference_probe.py; `bar`: where the stance check
    reads the user's words, `min_preference_gain_checked`); a weaker dose moves them less, so the
    first dose that does not ends the grid, and `gate.dose_refinements` bisections then look between
    it and the weakest dose that failed another check (`next_dose`)."""
    from clawflow.policy import preference_probe as P
    from clawflow.policy import stance_probe as S
    from clawflow.policy.dose import write_dosed

    per: dict[float, dict[str, float]] = {}
    pref = None
    champion_shown: dict[str, int] = {}
    if gate.enabled and gate.require_learning and not taught and len(scorable(judged)) < gate.judged_min_turns:
        m = {"dose": gate.doses[0], "judged_turns": float(len(scorable(judged)))}
        return DoseVerdict(False, f"nothing it learned can be measured: no standing preference, and "
                                  f"{len(scorable(judged))} held-out judged turns (fewer than {gate.judged_min_turns})",
                           None, candidate_dir, m, {gate.doses[0]: m})
    champion = Champion(champion_dir) if gate.enabled else None
    if taught and gate.enabled:
        t0 = time.monotonic()
        champ, tok = champion.model, champion.tok
        prompts, budget = P.load_prompts(gate.preference_prompts), gate.preference_max_tokens
        answers = P.answer_sets(cache_dir, champion_dir, prompts, taught, budget, lambda: (champ, tok))
        champ_lp = {k: P.answer_loglik(champ, tok, prompts, a) for k, a in answers.items()}
        pref = (tok, prompts, answers, champ_lp, time.monotonic() - t0)
        if gate.check_stances:  # the champion's plain answers are already here: its counts cost nothing
            champion_shown = S.shown_counts(taught, S.texts(tok, answers["plain"]))
    bar = P.bar(gate, S.has_room(champion_shown, len(pref[1]), gate.stance_margin) if pref else False)
    last: GateResult | None = None
    tried: list[tuple[float, str]] = []
    while (dose := next_dose(gate.doses, tried, gate.dose_refinements)) is not None:
        path = candidate_dir if dose == 1.0 else str(write_dosed(candidate_dir, champion_dir, dose,
                                                                 Path(work_dir) / f"dose-{dose:g}"))
        m: dict[str, float] = {"dose": dose}
        per[dose] = m
        cand = None  # loaded once per dose, for every check that reads it
        if pref is not None:
            from clawflow.helpfulness import load_model

            t0 = time.monotonic()
            tok, prompts, answers, champ_lp, teacher_s = pref
            cand, _ = load_model(path)
            cand_lp = {k: P.answer_loglik(cand, tok, prompts, a) for k, a in answers.items()}
            m.update(P.contrast(champ_lp["taught"], cand_lp["taught"], champ_lp["plain"], cand_lp["plain"]))
            m["pref_bar"] = bar
            m["seconds_preference"] = time.monotonic() - t0 + teacher_s
            pref = (*pref[:4], 0.0)  # the teachers' side is counted once, with the first dose
            if not m["pref_gain"] > bar:
                last = GateResult(False, f"the preference measure is {m['pref_gain']:+.4f} nats/token at dose "
                                         f"{dose:g} (teacher's answers {m['pref_gain_taught']:+.4f}, its own "
                                         f"{m['pref_gain_plain']:+.4f}), not past the champion's "
                                         f"(+{bar:g})", m)
                tried.append((dose, WEAK))
                continue
        r = evaluate(gate, path, champion_dir, judged, base_dir, cache_dir, champion, cand)
        m.update(r.metrics)
        if r.passed and gate.enabled and gate.require_learning and pref is None and not judged_learning(m, gate):
            last = GateResult(False, f"nothing learned on the held-out judged turns at dose {dose:g}: replies "
                                     f"judged good {m['judged_pos_delta']:+.4f}, bad {m['judged_neg_delta']:+.4f} "
                                     f"nats/token (needs good − bad > {gate.min_preference_gain})", m)
            tried.append((dose, WEAK))
            continue
        if r.passed and champion_shown:
            reason = S.measure(path, pref[0], pref[1], taught, champion_shown, m, gate.preference_max_tokens,
                               gate.stance_margin, cand)
            if reason:  # a weaker dose shows them less: the grid ends here, as for a weak measure
                last = GateResult(False, f"{reason} at dose {dose:g}", m)
                tried.append((dose, WEAK))
                continue
        if r.passed:
            said = f"; preference {m['pref_gain']:+.4f} nats/token" if "pref_gain" in m else ""
            if champion_shown:
                said += "; shown " + ", ".join(f"{k} {champion_shown[k]} → {int(m[S.key(k)])}" for k in champion_shown)
            return DoseVerdict(True, f"dose {dose:g}: {r.reason}{said}", dose, path, m, per)
        last = r
        tried.append((dose, FAILED))
    listed = ", ".join(f"{d:g}" for d in per)
    reason = (last.reason if last else "no dose") + (f" (doses tried: {listed})" if len(per) > 1 else "")
    return DoseVerdict(False, reason, None, candidate_dir, per[gate.doses[0]], per)
