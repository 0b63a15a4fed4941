"""Does the gate's preference measure rank candidates as the learning bench's hit-rate does? (#27)

The gate cannot know a persona's checker ("≤ 30 words"), so it promotes on a proxy: how much
likelier a candidate makes the preference-conditioned teacher's answers than the champion does,
minus the same for the champion's own answers (clawflow/policy/preference_probe.py `contrast`).
This reads a finished learning bench's home (bench/learning.py keeps it under /tmp), rebuilds every
dose the gate measured of every candidate (from the registered checkpoint and its parent, by the
gate's own interpolation), and measures the persona's hit-rate on the bench's held-out prompts
with greedy replies. It prints, per (version, dose), the gate's measure beside the hit-rate gain
over the parent, and Spearman's rank correlation of the two.

    PYTHONPATH=. .venv/bin/python bench/pref_ranking.py /tmp/clawflow-learning-terse-XXXX/terse
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from clawflow.config import Config, load_config

DOSES_TAG = re.compile(r"([\d.]+): pref_gain=([-\d.e]+)")


def gate_measures(doses_tag: str) -> dict[float, float]:
    """{dose: preference measure} from a version's `doses` tag ("1: pref_gain=0.2, help_facts_rate=0.5;
    0.75: ..."). Pure."""
    return {float(d): float(g) for d, g in DOSES_TAG.findall(doses_tag or "")}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation, ties at their mean rank. Pure."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def within_candidates(rows: list[dict]) -> tuple[int, int]:
    """(concordant, compared) pairs of doses of the same candidate: the measure and the hit-rate
    order them the same way (ties in either count as not concordant). This is the gate's own use
    of the measure, picking a candidate's dose; across candidates it is read against a threshold,
    and from different parents the two scales differ. Pure."""
    concordant = compared = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["version"] != b["version"]:
                continue
            compared += 1
            concordant += (a["measure"] - b["measure"]) * (a["hit_rate"] - b["hit_rate"]) > 0
    return concordant, compared


def registered_dose(tags: dict) -> float:
    """The dose a version's checkpoint was registered at (1 when the gate picked none). Pure."""
    return float(tags["dose"]) if tags.get("dose", "none") != "none" else 1.0


def dosed_dir(version_dir: str, parent_dir: str, registered_dose: float, dose: float, out: Path) -> str:
    """A checkpoint directory of the candidate at `dose` (the registered one when it is that dose)."""
    from clawflow.policy.dose import write_dosed

    if dose == registered_dose:
        return version_dir
    return str(write_dosed(version_dir, parent_dir, dose, out, written_at=registered_dose))


def hit_rate_of(model_dir: str, persona, prompts: list[str], max_tokens: int) -> tuple[float, float]:
    """(hit-rate, mean words) of the greedy replies (chat template, no system prompt)."""
    from clawflow import helpfulness as H
    from clawflow.envs.evaluation import hit_rate

    model, tok = H.load_model(model_dir)
    replies = H.greedy_replies(model, tok, prompts, max_tokens)
    return hit_rate(persona, replies), sum(len(r.split()) for r in replies) / len(replies)


def rows_of(cfg: Config, max_tokens: int, eval_prompts: int = 32, say=print) -> list[dict]:
    from clawflow.base_model import base_model_dir
    from clawflow.envs.evaluation import load_held_out
    from clawflow.envs.personas import load_personas
    from clawflow.policy import registry

    [persona], _ = load_personas(cfg.envs.personas_file, cfg.envs.personas)
    prompts = load_held_out(training_prompts=persona.prompts, persona=persona.name).eval_prompts[:eval_prompts]
    versions = {v["version"]: v for v in registry.list_versions(cfg)}
    local = {n: registry.checkpoint_dir(cfg, n, v["source"]) for n, v in versions.items()}
    local.setdefault(0, base_model_dir(cfg))  # v0: the base
    hits: dict[tuple[int, float], tuple[float, float]] = {}

    def hit(version: int, dose: float, registered_dose: float, parent: int) -> tuple[float, float]:
        if (version, dose) not in hits:
            with tempfile.TemporaryDirectory() as tmp:
                path = dosed_dir(local[version], local[parent], registered_dose, dose, Path(tmp) / "dosed") \
                    if version else local[version]
                hits[version, dose] = hit_rate_of(path, persona, prompts, max_tokens)
        return hits[version, dose]

    rows = []
    for n in sorted(v for v in versions if v):
        tags = versions[n]["tags"]
        parent = int(tags.get("parent_version", 0))
        measured = gate_measures(tags.get("doses", ""))
        written_at = registered_dose(tags)
        # the parent as it served: its registered checkpoint, at the dose it was promoted at
        served = registered_dose(versions[parent]["tags"]) if parent in versions else 1.0
        p_hit, _ = hit(parent, served, served, parent)
        for dose, measure in sorted(measured.items(), reverse=True):
            h, words = hit(n, dose, written_at, parent)
            row = {"version": n, "parent": parent, "dose": dose, "measure": measure, "hit_rate": h,
                   "parent_hit_rate": p_hit, "gain": h - p_hit, "words": words, "gate": tags.get("gate", "?")}
            say(f"v{n:<3} from v{parent:<3} dose {dose:<5g} measure {measure:+.4f}  hit-rate {h:.3f} "
                f"(parent {p_hit:.3f}, gain {h - p_hit:+.3f})  words {words:.1f}  {row['gate']}")
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("home", type=Path, help="a learning bench's persona home (holds bench-config.yaml)")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply tokens (default: the bench config's envs.max_tokens)")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts (bench/learning.py's default)")
    a = ap.parse_args(argv)
    config = a.home / "bench-config.yaml"
    if not config.is_file():
        print(f"pref_ranking: {config} not found: pass the persona home bench/learning.py printed", file=sys.stderr)
        return 2
    cfg = load_config(config)
    rows = rows_of(cfg, a.max_tokens or cfg.envs.max_tokens, a.eval_prompts)
    if len(rows) < 3:
        print(f"pref_ranking: {len(rows)} measured doses; a rank correlation needs 3 or more", file=sys.stderr)
        return 1
    rho = spearman([r["measure"] for r in rows], [r["gain"] for r in rows])
    print(f"Spearman rank correlation, gate's preference measure vs hit-rate gain over the parent: "
          f"{rho:+.3f} over {len(rows)} (version, dose) pairs")
    same, compared = within_candidates(rows)
    print(f"doses of one candidate ordered alike by the measure and the hit-rate: {same} of {compared} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
