"""The dose: a candidate interpolated toward the champion (issue #27).

A run that moved the preference but cost facts was rejected whole, and what it learned went with it.
Interpolating the fine-tuned weights toward where they started keeps most of the gain and recovers
robustness (WiSE-FT, Wortsman et al. 2022, arXiv 2109.01903); the gate (tasks/policy.py
`gate_doses`) measures the candidate at a few doses and promotes the strongest that passes.

One rule for both kinds of checkpoint: every tensor becomes champion + d·(candidate − champion).
For a LoRA adapter the tensors are the adapter's own (A and B); a champion without an adapter (the
base) counts as B = 0 with the candidate's A, so the dose is then exactly the adapter's scale d.
Full weights interpolate every floating tensor.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"


def interpolate(champion: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
                dose: float) -> dict[str, torch.Tensor]:
    """champion + dose·(candidate − champion) per tensor. A tensor the champion lacks (or holds in
    another shape) starts from zero when it is a LoRA B (the delta's output side), else from the
    candidate's own value. Pure."""
    if not 0.0 < dose <= 1.0:
        raise ValueError(f"dose must be in (0, 1], got {dose}")
    return blend(champion, candidate, dose)


def blend(champion: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
          factor: float) -> dict[str, torch.Tensor]:
    """`interpolate` for any factor: above 1 it extrapolates, which rebuilds a candidate from its
    checkpoint written at a dose (bench/pref_ranking.py). Pure."""
    out = {}
    for name, cand in candidate.items():
        champ = champion.get(name)
        if champ is None or champ.shape != cand.shape:
            champ = torch.zeros_like(cand) if "lora_B" in name else cand
        if not cand.is_floating_point():
            out[name] = cand
            continue
        mixed = champ.float() + factor * (cand.float() - champ.float())
        out[name] = mixed.to(cand.dtype).contiguous()
    return out


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [model_dir / ADAPTER_FILE] if (model_dir / ADAPTER_FILE).is_file() else sorted(model_dir.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def is_adapter(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "adapter_config.json").is_file()


def write_dosed(candidate_dir: str | Path, champion_dir: str | Path, dose: float, out: str | Path,
                written_at: float = 1.0) -> Path:
    """A copy of the candidate checkpoint at `out` with its weights at `dose` toward the champion.
    An adapter against a full-weight champion (the base) scales the adapter alone. `written_at`: the
    dose `candidate_dir` itself holds (a promoted version's checkpoint), rebuilt to `dose` exactly."""
    if not 0.0 < dose <= 1.0 or not 0.0 < written_at <= 1.0:
        raise ValueError(f"doses must be in (0, 1], got {dose} and {written_at}")
    from safetensors.torch import save_file

    cand_dir, champ_dir, out = Path(candidate_dir), Path(champion_dir), Path(out)
    adapter = is_adapter(cand_dir)
    champion = _weights(champ_dir) if adapter == is_adapter(champ_dir) else {}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cand_dir, tmp)
    if adapter:
        save_file(blend(champion, _weights(cand_dir), dose / written_at), str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    else:
        for f in sorted(cand_dir.glob("*.safetensors")):
            from safetensors.torch import load_file

            save_file(blend(champion, load_file(str(f)), dose / written_at), str(tmp / f.name), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
