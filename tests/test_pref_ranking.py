"""bench/pref_ranking.py's pure parts: the gate's per-dose measures read back from a version's tag,
a registered dose rebuilt at another dose exactly as the gate built it (policy/dose.py `blend`), and the rank correlation."""

from __future__ import annotations

import pytest
import torch

from bench.pref_ranking import gate_measures, registered_dose, spearman, within_candidates
from clawflow.policy.dose import blend, interpolate


def test_gate_measures_read_the_doses_tag():
    tag = "1: pref_gain=0.0167, help_facts_rate=0.53; 0.75: pref_gain=-2e-03, help_facts_rate=0.54"
    assert gate_measures(tag) == {1.0: 0.0167, 0.75: -0.002}
    assert gate_measures("") == {} and gate_measures("1: help_facts_rate=0.5") == {}


def test_a_parent_is_measured_at_the_dose_it_served():
    """A gain is over the parent as users got it: promoted at 0.75, its registered checkpoint (its
    dose-1 rebuild once stood in for it and credited v3 of a terse run with gains it never had)."""
    assert registered_dose({"dose": "0.75", "parent_version": "1"}) == 0.75
    assert registered_dose({"dose": "none"}) == 1.0 and registered_dose({}) == 1.0


@pytest.mark.parametrize("champion_has_adapter", [True, False])
def test_a_registered_dose_rebuilds_every_other_dose_as_the_gate_did(champion_has_adapter):
    g = torch.Generator().manual_seed(0)
    cand = {"x.lora_A.weight": torch.randn(4, 8, generator=g), "x.lora_B.weight": torch.randn(8, 4, generator=g),
            "steps": torch.tensor(3)}
    champ = {"x.lora_A.weight": torch.randn(4, 8, generator=g), "x.lora_B.weight": torch.randn(8, 4, generator=g)} \
        if champion_has_adapter else {}
    registered = interpolate(champ, cand, 0.5)  # promoted at dose 0.5
    for dose in (1.0, 0.75, 0.25):
        rebuilt, expected = blend(champ, registered, dose / 0.5), interpolate(champ, cand, dose)
        for name in expected:
            assert torch.allclose(rebuilt[name].float(), expected[name].float(), atol=1e-5), (dose, name)
    assert not torch.allclose(blend(champ, registered, 2.0)["x.lora_B.weight"], registered["x.lora_B.weight"])


def test_spearman_ranks_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [0, 0, 1]) == pytest.approx(0.866, abs=1e-3)  # ties share their mean rank
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # nan: no order to compare


def test_doses_are_compared_only_within_their_candidate():
    rows = [{"version": 2, "measure": 0.14, "hit_rate": 0.90}, {"version": 2, "measure": 0.11, "hit_rate": 0.81},
            {"version": 3, "measure": 0.06, "hit_rate": 1.00}, {"version": 3, "measure": 0.05, "hit_rate": 0.94},
            {"version": 3, "measure": 0.04, "hit_rate": 0.94}, {"version": 4, "measure": 0.30, "hit_rate": 0.10}]
    # v2: 1 pair, v3: 3 pairs of which one ties on the hit-rate; v4 alone; never v2 against v3
    assert within_candidates(rows) == (3, 4)
    rows[1]["measure"] = 0.2  # now v2's doses disagree
    assert within_candidates(rows) == (2, 4)
