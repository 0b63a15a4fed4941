"""The shipped path is the tested path (issue 28, item 3): `train-on-new-feedback` end to end, under a
real Prefect API (the test harness), a real MLflow store, real Parquet shards and DuckDB catalog, the
rules judge and a real torchrun training, with configs/default.yaml's `train` and `gate` sections as
they ship: LoRA, `distill` with best-of-N rewrites and the strongest hint, rehearsal, `kl_beta` (the
KL reference is the policy with its adapter switched off), standing preferences distilled over broad
prompts, and the gate with its doses, the preference measure and the helpfulness check on.

The model is the suite's tiny random-weight one (tests/conftest.py `tiny_model_dir`). Only what a
random model cannot do, or what time forces, departs from the shipped sections: each departure is in
`OVERRIDES` with the reason, and the test asserts that every other field of `train` and `gate`
(shipped keys and defaults alike) is what configs/default.yaml gives.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from test_gate_judged import seal_turns
from transformers import AutoTokenizer

from clawflow.config import REPO_ROOT, load_config
from clawflow.contracts.turn import TurnRecord
from clawflow.policy import registry, reload
from clawflow.policy.holdout import in_holdout
from clawflow.train.rewrite import content_words
from conftest import drain_prefect_events

SHIPPED_FILE = REPO_ROOT / "configs" / "default.yaml"

# Requests made of function words only (train/rewrite.py `content_words` finds none in them): a rewrite
# by a random-weight model passes `addresses` whatever it says, as long as it says something.
FUNCTION_WORD_PROMPTS = [
    "What is it?", "Can you do that?", "How would that be?", "Why is it so?", "Who is it?", "Where is it?",
    "When was that?", "Which one is it?", "How is that?", "Why not?", "Can we do this?", "Would you do it?",
    "Is this one?", "Was that so?", "Are those here?", "Could it be?", "What was it?", "What is that?",
    "What was that?", "What is this?", "What are these?", "What were those?", "Who was that?", "Where was that?",
    "When is it?", "When was this?", "Why was that?", "How was that?", "Could you do that?", "Would you do this?",
    "Should we do it?", "Will it be?", "Might it be so?", "Must we?", "Is that all?", "Is it you?",
    "Are you there?", "Was it me?", "Which is mine?", "Is this yours?", "Do you know?", "Does it?",
]

# Every departure from configs/default.yaml's `train` and `gate` sections, and why. A value naming a
# `.yaml` file is a file this test writes into its temp dir (`write_files`).
OVERRIDES: dict[str, dict] = {
    "train": {
        # Rehearsal keeps a rewrite only when it states its question's key fact, and the hint-strength
        # and degeneracy probes of standing preferences answer this file's first 4 questions. A random
        # model states no fact and shares no word with a real question, so with configs/train/
        # rehearsal.yaml every rehearsal rewrite is left out: function-word questions, facts ".*"
        # (as tests/test_train_preferences.py). Still >= the shipped `rehearsal: 16` of them.
        "rehearsal_prompts": "rehearsal.yaml",
        # The broad prompts (configs/train/prompts.yaml) are topical: a random model's rewrite never
        # shares a content word with them and all 32 would be left out (train/rewrite.py `addresses`).
        # Function-word prompts instead, more than the shipped `broad_prompts: 32`.
        "broad_prompts_file": "prompts.yaml",
        # Time: a random model never samples EOS, so every rewrite runs the whole budget. At the default
        # 128, the 50 rewrites x (1 + 4) candidates took 397 s on 2 busy cores (and ~55 training steps
        # followed, 95 s more); 12 tokens still give every step rewritten replies to learn.
        "rewrite_max_tokens": 12,
        # Time: on 2 cores shared with other test processes, sampling the rewrites ran 0.29 s a token
        # step with 1 thread and 0.65 s with torch's default 2 (configs/test.yaml pins 1 for the same reason).
        "threads": 1,
    },
    "gate": {
        # Time: the shipped 217 questions are answered (32 tokens each) by the candidate at every dose
        # tried (up to 4) and by the champion and the base: 258 s of gate on 2 busy cores. The first 24
        # of the shipped questions (facts and degeneracy are shares: the thresholds mean the same).
        "helpfulness": {"questions": "helpfulness.yaml"},
        # Time: the teacher's answers to the shipped 42 held-out prompts, scored at every dose; the first 8.
        "preference_prompts": "preference_prompts.yaml",
    },
}
HELPFULNESS_QUESTIONS, PREFERENCE_PROMPTS = 24, 8


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_files(root: Path) -> dict[str, str]:
    """The files `OVERRIDES` names, written under `root`; {file name: path}."""
    from clawflow import helpfulness
    from clawflow.train.prompts import PREFERENCE_FILE, load_prompts

    root.mkdir(parents=True, exist_ok=True)
    files = {
        "rehearsal.yaml": {"questions": [{"prompt": p, "facts": [".*"]} for p in FUNCTION_WORD_PROMPTS]},
        "prompts.yaml": {"prompts": [{"prompt": p, "kind": "smalltalk"} for p in FUNCTION_WORD_PROMPTS]},
        "helpfulness.yaml": {"questions": [{"prompt": q.prompt, "facts": q.facts}
                                           for q in helpfulness.load_questions()[:HELPFULNESS_QUESTIONS]]},
        "preference_prompts.yaml": {"prompts": [{"prompt": p.prompt, "kind": p.kind}
                                                for p in load_prompts(PREFERENCE_FILE)[:PREFERENCE_PROMPTS]]},
    }
    out = {}
    for name, body in files.items():
        (root / name).write_text(yaml.safe_dump(body))
        out[name] = str(root / name)
    return out


def resolve_files(section: dict, files: dict[str, str]) -> dict:
    return {k: resolve_files(v, files) if isinstance(v, dict) else files.get(v, v) if isinstance(v, str) else v
            for k, v in section.items()}


def shipped_recipe_config(tmp_path: Path, tiny_model_dir: str):
    """configs/test.yaml's model, store, serving and judge (the tiny model, a temp home, the rules
    judge); configs/default.yaml's `train` and `gate` sections verbatim, then `OVERRIDES`."""
    shipped = yaml.safe_load(SHIPPED_FILE.read_text())
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["model"] = {"name": "clawflow-tiny", "path": tiny_model_dir}
    files = write_files(tmp_path / "override-files")
    for section in ("train", "gate"):
        raw[section] = deep_merge(shipped[section], resolve_files(OVERRIDES[section], files))
    path = tmp_path / "shipped-recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path), load_config(SHIPPED_FILE)


def champion_adapter(cfg, base_dir: str, out: Path) -> Path:
    """An earlier version's LoRA adapter (the shipped r, alpha, targets) with non-zero weights.

    Why not the base as the champion: the random base answers every prompt with newlines only, so the
    trainer (rightly) drops every standing preference as degenerate (train/rewrite_choice.py
    `degenerate_hints`) and nothing of the broad prompts, rehearsal or the gate's preference measure
    would run. And a champion whose adapter is non-zero is what makes the KL reference observable:
    the run starts from this adapter, the reference is the same model with it switched off, so the
    very first step's `kl` is > 0 only when that reference was really computed (without it the
    recipe falls back to pi_old, which at step 1 is the training forward itself: kl 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from clawflow.train.checkpoint import copy_tokenizer

    spec = cfg.train.lora
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                      target_modules=list(spec.target_modules), init_lora_weights=False,
                                      task_type="CAUSAL_LM"))
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    model.save_pretrained(out)
    copy_tokenizer(Path(base_dir), out)
    return out


T0 = datetime(2026, 3, 2, tzinfo=UTC)
CORRECTIONS = {  # session -> what the user said next; the rules judge scores both −1 and lifts them as hints
    "s1": "No, that's too long. Please keep replies under 30 words.",
    "s4": "Too wordy. Shorter please.",
}
PRAISE = "Thanks, perfect!"
LONG_REPLY = ("Well, there is a great deal to say about that, so let me go through every part of it in detail, "
              "one careful step at a time, before I get to the point.")


def sessions(tok, version: int) -> list[tuple[TurnRecord, TurnRecord, int]]:
    """Six sessions served by `version`: a request, the long reply, then the user's next message:
    a length correction (s1, s4) or thanks."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok(LONG_REPLY, add_special_tokens=False)["input_ids"] + [end]
    out = []
    for k in range(6):
        sid = f"s{k}"
        said = CORRECTIONS.get(sid, PRAISE)
        messages = [{"role": "user", "content": FUNCTION_WORD_PROMPTS[k]}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        first = TurnRecord(session_id=sid, turn_index=0, policy_version=version, messages=messages,
                           prompt_token_ids=prompt, response_token_ids=reply, response_logprobs=[-2.0] * len(reply),
                           response_text=LONG_REPLY, finish_reason="stop", new_messages=messages,
                           turn_id=f"turn-{k}", created_at=T0 + timedelta(seconds=k))
        history = [*messages, {"role": "assistant", "content": LONG_REPLY}, {"role": "user", "content": said}]
        second = TurnRecord(session_id=sid, turn_index=1, policy_version=version, messages=history,
                            prompt_token_ids=list(tok.apply_chat_template(history, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=False)),
                            response_token_ids=[end], response_logprobs=[-1.0],
                            response_text="", finish_reason="stop", new_messages=[history[-1]],
                            turn_id=f"next-{k}", created_at=T0 + timedelta(seconds=k, milliseconds=500))
        out.append((first, second, -1 if sid in CORRECTIONS else 1))
    return out


def failed_checks(g) -> dict[str, object]:
    """What a rejection names (clawflow/policy/gate.py, clawflow/helpfulness.py) -> what the figures of the
    dose it was rejected at must then show (None: nothing to recompute from the figures)."""
    h = g.helpfulness
    return {
        "the preference measure is": lambda m: m["pref_gain"] <= m["pref_bar"] in (
            g.min_preference_gain, g.min_preference_gain_checked),
        "helpfulness fell": lambda m: m["help_facts_rate"] < max(m["help_facts_rate_champion"],
                                                                 m["help_facts_rate_base"]) - h.margin,
        "repeat another question's answer": lambda m: m["help_duplicate_share"] > h.max_duplicate_share,
        "of answers loop": lambda m: m["help_repetitive_share"] > h.max_repetitive_share,
        "of answers are empty": lambda m: m["help_empty_share"] > h.max_empty_share,
        "unrelated to their question": lambda m: m["help_offtopic_share"] > min(
            m["help_offtopic_share_champion"], m["help_offtopic_share_base"]) + h.max_offtopic_increase,
        "show the user's preferences less": lambda m: any(
            m[f"{k}.champion"] - m[k] > g.stance_margin * m["shown_answers"] for k in stances(m)),
        "do not show the user's preferences more": lambda m: not joint_rose(m, g.stance_margin),
        "probe KL": lambda m: m["probe_kl"] > g.max_kl,
        "probe NLL rose": lambda m: m["probe_nll_increase"] > g.max_nll_increase,
        "held-out replies judged": None, "helpfulness check failed": None, "non-finite weights": None,
    }


def stances(m: dict[str, float]) -> list[str]:
    """The candidate's figures of the user's checkable stances (clawflow/policy/stance_probe.py)."""
    return [k for k in m if k.startswith("shown.") and not k.endswith(".champion")]


def joint_rose(m: dict[str, float], margin: float) -> bool:
    """Did the answers showing every checkable stance at once (or the one) rise past the margin?"""
    k = "shown.every_stance" if "shown.every_stance" in m else stances(m)[0]
    return m[k] - m[f"{k}.champion"] > max(margin * m["shown_answers"], 0.5)


def log_count(log: str, pattern: str) -> tuple[int, int] | None:
    m = re.search(pattern, log)
    return (int(m.group(1)), int(m.group(2))) if m else None


@pytest.fixture
def one_torch_thread():
    """The gate runs in this process (a Prefect task): one torch thread, as the trainer's `threads: 1`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # one flow run: torchrun training and the gate at up to 4 doses
def test_shipped_train_and_gate_sections_run_end_to_end(tmp_path, tiny_model_dir, prefect_api, one_torch_thread):
    from flows.train_on_new_feedback import train_on_new_feedback

    from clawflow.prefs.store import PreferenceStore
    from clawflow.train.checkpoint import META_FILE
    from clawflow.train.recipe import PREFERENCES_REPORT

    cfg, shipped = shipped_recipe_config(tmp_path, tiny_model_dir)

    # -- the sections are the shipped ones, but for OVERRIDES --------------------------------------
    over = {s: flatten(OVERRIDES[s]) for s in ("train", "gate")}
    for section, ours, theirs in (("train", cfg.train, shipped.train), ("gate", cfg.gate, shipped.gate)):
        mine, ship = flatten(ours.model_dump(mode="json")), flatten(theirs.model_dump(mode="json"))
        assert set(mine) == set(ship) and set(over[section]) <= set(ship)
        differ = {k: (mine[k], ship[k]) for k in ship if mine[k] != ship[k]}
        assert set(differ) <= set(over[section]), f"{section}: not shipped and not in OVERRIDES: {differ}"
    t, g = cfg.train, cfg.gate  # the recipe this test is about is what ships (else it tests something else)
    assert t.lora is not None and t.objective == "distill" and t.rewrite_samples > 0 and t.rewrite_hints == "strongest"
    assert t.rehearsal > 0 and t.broad_prompts > 0 and t.kl_beta > 0
    assert g.enabled and g.helpfulness.enabled and len(g.doses) > 1 and g.doses == sorted(g.doses, reverse=True)
    assert len(FUNCTION_WORD_PROMPTS) >= max(t.rehearsal, t.broad_prompts)  # the files do not cut the counts
    assert not any(content_words(p) for p in FUNCTION_WORD_PROMPTS)

    # -- the base (v1) and an earlier LoRA version (v2, champion) in the registry -----------------
    drain_prefect_events()
    assert reload.provision(cfg) == (1, tiny_model_dir)
    v2_dir = champion_adapter(cfg, tiny_model_dir, cfg.home / "checkpoints" / "earlier-v2")
    run = registry.start_run(cfg, "train-from-v1", {"objective": t.objective}, {"clawflow.parent_version": "1"})
    assert registry.register_checkpoint(cfg, run, v2_dir, {"parent_version": "1", "turn_count": "0"}) == 2
    registry.end_run(cfg, run)
    registry.promote(cfg, 2)

    # -- conversations served by v2, with their next states, sealed into Parquet shards ----------------
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seal_turns(cfg.home, sessions(tok, 2))

    state = train_on_new_feedback(config_path=str(cfg.source_file), reload=False, return_state=True)
    result = state.result()
    print("gate:", result.get("gate"))  # the verdict, as the flow prints it
    assert result["trained"] and result["parent"] == 2 and result["version"] == 3, result
    assert result["samples"] + result["held_out"] == 6 and result["preferences"] == 1, result
    # corrected turns in the batch (the shipped 10 % holdout may keep one out for the gate)
    corrected = sum(not in_holdout(f"turn-{sid[1:]}", g.holdout_fraction) for sid in CORRECTIONS)

    # -- a standing preference recorded from the concrete corrections -------------------------------
    active = PreferenceStore.for_config(cfg).active("default")
    assert len(active) == 1, active
    pref = active[0]
    assert (pref.axis, pref.pole, pref.number) == ("length", "short", 30)
    assert sorted(v.text for v in pref.variants) == sorted(CORRECTIONS.values()) and pref.sessions == ["s1", "s4"]
    assert all(v.strength is not None for v in pref.variants)  # measured by the run and written back

    # -- it trained: a LoRA adapter from v2, with rehearsal, broad prompts and the KL reference --------
    ckpt = cfg.home / "checkpoints" / result["mlflow_run"]
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    assert not list(ckpt.glob("model*.safetensors"))  # adapter-only
    meta = json.loads((ckpt / META_FILE).read_text())
    assert meta["lora"] and meta["objective"] == "distill" and meta["parent_version"] == 2
    counts = meta["counts"]
    assert counts["rehearsal"] == t.rehearsal and counts["broad"] == t.broad_prompts, counts
    report = json.loads((ckpt / PREFERENCES_REPORT).read_text())
    assert report["taught"] and not report["dropped"], report  # the preference was distilled, not dropped
    assert set(report["strengths"]) == set(CORRECTIONS.values())
    log = (ckpt.parent / f"{ckpt.name}.log").read_text()
    assert f"best of {1 + t.rewrite_samples} rewrites by 'plain'" in log
    assert f"the teacher reads {report['taught']!r}" in log
    broad = log_count(log, r"clawflow\.train: (\d+) of (\d+) general prompts distil the standing preferences")
    assert broad is not None and broad[0] > 0 and broad[1] == t.broad_prompts, broad
    # rewrites kept = broad + rehearsal + corrected turns: rehearsal answers were kept too
    rewritten = int(re.search(r"clawflow\.train: rewrote (\d+) replies", log).group(1))
    left_out = log_count(log, r"clawflow\.train: (\d+) of (\d+) rewrites left out") or (0, rewritten)
    assert left_out[1] == rewritten == corrected + t.rehearsal + t.broad_prompts, (rewritten, left_out)
    assert rewritten - left_out[0] - broad[0] - corrected > 0, (rewritten, left_out, broad)

    # -- after the run, the next run's rehearsal and general-prompt rewrites were prepared from the champion
    from clawflow.train.rewrite_cache import RewriteCache

    assert result["prepared"] and result["prepare_seconds"] is not None, result
    champion_dir = registry.checkpoint_dir(cfg, *registry.champion(cfg), trainer_state=True)  # as the flow reads it
    prepared = RewriteCache(cfg.home / "rewrites", champion_dir, t).data
    assert len(prepared["replies"]) >= t.broad_prompts and len(prepared["strengths"]) == 1, \
        (champion_dir, len(prepared["replies"]))

    metrics = json.loads((ckpt / "train_metrics.json").read_text())
    steps = metrics["per_step"]
    assert steps and metrics["steps"] == len(steps) >= 2
    assert all(s["sft_tokens"] > 0 for s in steps)  # every step learns rewrites (distill)
    if t.kl_reference == "base":
        # The KL reference really ran: at step 1 the weights are v2's, pi_old is the forward itself, and
        # the reference is v2 with its adapter switched off; a missing reference would read 0 here.
        assert steps[0]["kl"] > 1e-6, steps[0]
    else:  # `start`: the reference is v2 itself (pi_old): 0 at the first step, then the run's own drift
        assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and max(s["kl"] for s in steps[1:]) > 1e-6, steps
    for s in steps:  # and it is in the loss with the shipped weight
        assert s["loss"] == pytest.approx(s["pg_loss"] + t.kl_beta * s["kl"], rel=1e-5, abs=1e-7)
    kl_history = MlflowClient(cfg.tracking_uri).get_metric_history(result["mlflow_run"], "kl")
    assert [m.value for m in sorted(kl_history, key=lambda m: m.step)] == pytest.approx([s["kl"] for s in steps])

    # -- the gate's verdict, on the version's tags; promoted or rejected for the reason it prints -----
    reason = result["gate"]
    version = {v["version"]: v for v in registry.list_versions(cfg)}[3]
    tags = version["tags"]
    assert tags["gate_reason"] == reason and tags["doses"] and "dose" in tags
    tried = [float(d.split(":")[0]) for d in tags["doses"].split("; ")]
    on_grid = [d for d in tried if d in g.doses]
    assert on_grid and on_grid == g.doses[: len(on_grid)], tags["doses"]  # strongest first, in the shipped order
    assert tried[: len(on_grid)] == on_grid and len(tried) - len(on_grid) <= g.dose_refinements  # then bisections
    assert all(min(on_grid) < d < 1.0 for d in tried[len(on_grid):]), tags["doses"]
    assert all("pref_gain=" in d for d in tags["doses"].split("; "))  # the preference measure, at every dose
    champion = registry.champion(cfg)[0]
    run_metrics = MlflowClient(cfg.tracking_uri).get_run(result["mlflow_run"]).data.metrics
    prefix = f"dose_{tried[-1]:g}."  # the figures of the last dose measured: the chosen one, or the last rejected
    last = {k.removeprefix(prefix): v for k, v in run_metrics.items() if k.startswith(prefix)}
    assert last["dose"] == tried[-1] and "pref_gain" in last, last
    if result["promoted"]:
        assert tags["gate"] == "passed" and champion == 3 and "rejected" not in tags
        assert float(tags["dose"]) == result["dose"] == tried[-1] and reason.startswith(f"dose {tags['dose']}: ")
        assert "key facts" in reason and "preference +" in reason  # helpfulness and the preference measure passed
        h = g.helpfulness
        assert last["pref_gain"] > last["pref_bar"] in (g.min_preference_gain, g.min_preference_gain_checked)
        assert last["probe_kl"] <= g.max_kl
        assert last["help_facts_rate"] >= max(last["help_facts_rate_champion"], last["help_facts_rate_base"]) - h.margin
        assert last["help_duplicate_share"] <= h.max_duplicate_share and last["help_empty_share"] <= h.max_empty_share
        assert last["help_repetitive_share"] <= h.max_repetitive_share
    else:
        assert tags["gate"] == "rejected" and tags["rejected"] == reason and tags["dose"] == "none"
        assert champion == 2 and result["dose"] is None
        if len(tried) > 1:
            assert reason.endswith(f"(doses tried: {', '.join(f'{d:g}' for d in tried)})"), reason
        named = {c: check for c, check in failed_checks(g).items() if c in reason}
        assert len(named) == 1, f"a rejection names the one check that failed: {reason!r}"
        (check,) = named.values()
        assert check is None or check(last), (reason, last)  # the figures say what the reason says
        if "help" in reason or "answers" in reason:
            assert "help_facts_rate" in last  # the helpfulness check ran at that dose
