"""What every configuration section shares: strict models (an unknown key is an error) and the repo root."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
