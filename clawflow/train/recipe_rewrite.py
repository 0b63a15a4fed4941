"""The recipe's rewrite phase (train/recipe.py): before training, the hinted policy writes the new
replies distillation learns from: every corrected turn's, and with standing preferences the
rehearsal questions' and general prompts' (train/plan.py), each read in the preferences' strongest
words, best of N, kept across runs (train/rewrite_cache.py), and left out where it does not show
what its teacher read. `--prepare` runs this phase alone, for the next run.

A mixin of `Recipe`: it reads and sets the run's state (`items`, `cache`, `plan`, the rank).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import torch

from clawflow.config import load_config
from clawflow.policy.loader import load_policy as load_full_policy
from clawflow.policy.loader import tokenizer_for
from clawflow.policy.packed_linear import pack_if_faster, unpack_linears
from clawflow.prefs.shows import label, unshown
from clawflow.train import distributed as D
from clawflow.train.launch import EXIT_NO_SAMPLES
from clawflow.train.lora import merged_copy
from clawflow.train.plan import InputError, Item, plan_steps
from clawflow.train.rewrite import eos_token_ids, generate_rewrites
from clawflow.train.rewrite_cache import RewriteCache
from clawflow.train.rewrite_choice import best_of_n, degenerate_hints, strongest_hint, usable_rewrite
from clawflow.train.teacher import teacher_prompt_ids


class RewritePhase:
    def prepare_only(self) -> None:
        """`--prepare`: the rewrites (and preference strengths) the next run from these weights will
        read, written to `--cache-dir`; no training. The flow runs it right after a promotion."""
        self.load_and_rewrite()
        self._log(f"clawflow.train: prepared {len(self.items)} usable rewrites for the next run from {self.start_dir}"
                  + ("" if self.items else " (it trains on its own corrected turns alone)"))
        taught = (self.pref_report or {}).get("taught")
        if self.rank == 0 and taught and getattr(self.args, "gate_cache", None):
            self.prepare_gate(taught)

    def prepare_gate(self, taught: str) -> None:
        """The gate's preference measure for a candidate of the next run needs the teacher's answers
        (these weights with `taught` in the system prompt) and their plain ones: written into the
        gate's cache now."""
        from clawflow.helpfulness import load_model
        from clawflow.policy import preference_probe as P

        gate = load_config(self.args.config).gate
        if not gate.enabled:
            return
        t0, prompts = time.monotonic(), P.load_prompts(gate.preference_prompts)
        P.answer_sets(self.args.gate_cache, str(self.start_dir), prompts, taught, gate.preference_max_tokens,
                      lambda: load_model(str(self.start_dir)))  # as the gate loads the champion
        self._log(f"clawflow.train: prepared the gate's teacher answers in {time.monotonic() - t0:.1f} s")

    def rewrite(self, model) -> None:
        """distill: the hinted policy writes each corrected turn's new reply (train/rewrite.py), with the
        start-of-run weights, before FSDP shards them; a resumed run reuses the saved rewrites, any run
        what was written before with the same weights (`--cache-dir`, train/rewrite_cache.py)."""
        todo = [it for it in self.items if it.rewrite]
        if not todo:
            return
        done = self.cache.setdefault("rewrite", {})
        missing = [it for it in todo if it.index not in done]
        if "preferences" in self.cache:  # a resumed run: what its first start measured and dropped
            self.pref_report = self.cache["preferences"]
            self.dropped = set(self.cache["dropped"])
        tok = tokenizer_for(self.base_dir)  # the one the plan used (train/plan.py), not loaded again
        by_base = self.cfg.rewrite_teacher == "base"
        kept = RewriteCache(self.args.cache_dir, self.base_dir if by_base else self.start_dir, self.cfg) \
            if getattr(self.args, "cache_dir", None) and self.rank == 0 else None
        # generation is decode-bound: an adapter merged into a copy of its base (peft's unmerged LoRA
        # layers cost 1.2x a decode step) and, on CPU, the serving engine's packed fp32 Linears where
        # they are faster (policy/packed_linear.py; the same fp32 math), unpacked before training
        gen, packed = None, False

        def generator():
            nonlocal gen, packed
            if gen is None:
                gen = load_full_policy(self.base_dir, torch.float32).to(self.device).eval() if by_base \
                    else merged_copy(model)
                packed = self.device.type == "cpu" and pack_if_faster(gen)
            return gen

        try:
            if missing and self.preferences:
                self.use_preferences(generator, missing, tok, kept)
                missing = [it for it in missing if it.index not in self.dropped]
            elif missing and self.cfg.rewrite_hints == "strongest":
                self.use_strongest_hint(generator(), missing, tok)
            if missing:
                reused = {it.index: r for it in missing if kept is not None
                          and (r := kept.reply(self.teacher_key(it), it.prompt)) is not None}
                reused = D.broadcast_from_rank0(reused)
                if reused:
                    done.update(reused)
                    missing = [it for it in missing if it.index not in reused]
                    self._log(f"clawflow.train: {len(reused)} rewrites written before with these weights, reused "
                              f"(the prepare step or an earlier run)")
            if missing:
                t0 = time.monotonic()
                if self.cfg.rewrite_samples or self.cfg.rewrite_guidance:
                    replies = self.best_of_n(generator(), missing, tok) if self.rank == 0 else []
                else:
                    replies = generate_rewrites(generator(), [it.teacher_prompt for it in missing],
                                                self.cfg.rewrite_max_tokens, eos_token_ids(model), self.pad_id)
                replies = D.broadcast_from_rank0(replies)
                done.update(zip((it.index for it in missing), replies))
                if kept is not None:
                    kept.add_replies(((self.teacher_key(it), it.prompt), r) for it, r in zip(missing, replies))
                self._log(f"clawflow.train: rewrote {len(missing)} replies (corrected turns, rehearsal, general "
                          f"prompts) with "
                          f"hints in {time.monotonic() - t0:.1f} s (mean {sum(map(len, replies)) / len(replies):.0f} "
                          f"tokens{', packed Linears' if packed else ''})")
        finally:
            if packed and gen is model:
                unpack_linears(model)
            del gen
        eos, off, not_shown = eos_token_ids(model), set(self.dropped), Counter()
        for it in todo:
            if it.index in off:
                continue
            it.response, it.rollout = list(done[it.index]), [0.0] * len(done[it.index])
            text = tok.decode(it.response, skip_special_tokens=True)
            missed = unshown(it.hint, text) if self.cfg.verify_stances else []
            not_shown.update(label(st) for st in missed)
            if missed or not usable_rewrite(it, it.response, text, eos):
                off.add(it.index)
        if off:
            self._log(f"clawflow.train: {len(off)} of {len(todo)} rewrites left out (empty, off the request, "
                      f"without the key fact, of a dropped preference, or not showing what their teacher read)")
        if not_shown:
            self._log("clawflow.train: rewrites whose teacher did not show what it read (train.verify_stances), "
                      "by stance: " + json.dumps(dict(not_shown)))
        broad = [it for it in todo if it.broad]
        if broad:
            self._log(f"clawflow.train: {sum(it.index not in off for it in broad)} of {len(broad)} general prompts "
                      f"distil the standing preferences")
        self.items = [it for it in self.items if it.index not in off]
        if not self.items and not getattr(self.args, "prepare", False):  # prepare: kept, the next run has its own turns
            raise InputError("no rewritten reply is usable (empty, off the request, without the key fact, of a "
                             "dropped preference, or not showing what its teacher read): nothing to train on",
                             code=EXIT_NO_SAMPLES)
        self.plan = plan_steps(self.items, self.cfg.step_tokens, self.cfg.seed)  # packed by the new lengths
        self.total_steps = len(self.plan) * self.cfg.epochs

    def teacher_key(self, it: Item):
        """What a rewrite is kept under across runs (train/rewrite_cache.py): a general prompt's or a
        rehearsal question's, under the ids of the standing preferences its teacher read (a stronger
        wording of the same preference keeps it); any other, under its hinted prompt."""
        if self.taught_ids and (it.broad or it.facts):
            return {"preferences": self.taught_ids, "facts": list(it.facts), "system": it.broad or
                    self.cfg.rewrite_hint == "system"}
        return it.teacher_prompt

    def use_strongest_hint(self, model, items: list[Item], tok) -> None:
        """`train.rewrite_hints: strongest`: every rewrite's prompt rebuilt with the run's strongest hint
        (train/rewrite_choice.py), measured on rank 0."""
        hints = sorted({it.hint.strip() for it in items if it.hint.strip()})
        if len(hints) < 2:
            return
        if self.rank == 0:
            best, strength = strongest_hint(model, tok, hints, self.cfg, self.pad_id, self.device)
            self._log("clawflow.train: hint strengths " + json.dumps({h[:40]: round(v, 3) for h, v in strength.items()})
                      + f"; every rewrite reads {best!r}")
        best = D.broadcast_from_rank0(best if self.rank == 0 else None)
        in_system = self.cfg.rewrite_hint == "system"
        for it in items:
            if it.messages is not None:
                it.hint = best
                it.teacher_prompt = teacher_prompt_ids(tok, it.messages, best, it.tools, in_system=in_system)

    def use_preferences(self, generator, items: list[Item], tok, kept: RewriteCache | None = None) -> None:
        """Standing preferences (`--preferences`): every variant's strength measured (rank 0), each
        preference read in its strongest words, one whose teacher answers are empty or off the
        question dropped for this run; every rewrite then reads them (a corrected turn adds its own
        hint when that one is about the turn's content, not a standing preference). What was measured
        for the same preferences and weights before (`kept`) is reused."""
        from clawflow.prefs.axes import stance
        from clawflow.prefs.update import teacher_text

        report = None
        if self.rank == 0:
            key = [[p["pref_id"], sorted(p["variants"])] for p in self.preferences] + [self.cfg.max_preferences]
            report = kept.preference_report(key) if kept is not None else None
            if report is not None:
                self._log("clawflow.train: preference strengths measured before with these weights, reused")
            else:
                model = generator()
                texts = sorted({v for p in self.preferences for v in p["variants"]})
                _, strength = strongest_hint(model, tok, texts, self.cfg, self.pad_id, self.device)
                prefs = []
                for p in self.preferences:
                    best = max(p["variants"], key=lambda v: strength.get(v, float("-inf")))
                    prefs.append({"pref_id": p["pref_id"], "text": best, "strength": strength.get(best, 0.0)})
                prefs.sort(key=lambda p: -p["strength"])
                bad = degenerate_hints(model, tok, [p["text"] for p in prefs], self.cfg, self.pad_id)
                good = [p for p in prefs if p["text"] not in bad]
                report = {"strengths": strength,
                          "taught": teacher_text([p["text"] for p in good], self.cfg.max_preferences),
                          "preferences": prefs, "dropped": [{**p, "why": bad[p["text"]]} for p in prefs
                                                            if p["text"] in bad]}
                if kept is not None:
                    kept.add_preference_report(key, report)
        self.pref_report = self.cache["preferences"] = report = D.broadcast_from_rank0(report)
        off = {d["pref_id"] for d in report["dropped"]}
        read = [p["pref_id"] for p in report["preferences"] if p["pref_id"] not in off]  # strongest first
        self.taught_ids = sorted(read[: self.cfg.max_preferences]) if report["taught"] else []
        self._log("clawflow.train: preference strengths " + json.dumps({k[:40]: round(v, 3) for k, v in
                                                                         report["strengths"].items()}))
        for d in report["dropped"]:
            self._log(f"clawflow.train: preference {d['pref_id']} ({d['text'][:50]!r}) dropped for this run: {d['why']}")
        taught = report["taught"]
        self._log(f"clawflow.train: the teacher reads {taught!r}")
        for it in items:
            if it.messages is None:
                continue
            if not taught and (it.broad or it.facts):
                self.dropped.add(it.index)  # nothing left to practise
                continue
            own = it.hint.strip() if not (it.broad or it.facts) else ""
            it.hint = " ".join(x for x in (taught, own if own and stance(own) is None else "") if x)
            it.teacher_prompt = teacher_prompt_ids(tok, it.messages, it.hint, it.tools,
                                                   in_system=it.broad or self.cfg.rewrite_hint == "system")
        self.cache["dropped"] = sorted(self.dropped)

    def best_of_n(self, model, items: list[Item], tok) -> list[list[int]]:
        cfg = self.cfg
        chosen, usable = best_of_n(model, tok, items, cfg, self.pad_id)
        guided = f" with guidance {cfg.rewrite_guidance}" if cfg.rewrite_guidance else ""
        self._log(f"clawflow.train: best of {1 + cfg.rewrite_samples} rewrites by {cfg.rewrite_select!r}{guided}: "
                  f"{usable:.2f} of the candidates usable")
        return [chosen[it.index] for it in items]
