"""Environments: simulated users and terminal tasks that talk to the served policy through the
gateway, so users without heavy traffic still produce trajectories with real next states."""

from __future__ import annotations

from clawflow.config import Config
from clawflow.envs.base import Environment


def build_envs(cfg: Config) -> list[Environment]:
    """The configured environments, loaded from their YAML files."""
    from clawflow.envs.personas import PersonaEnv, load_personas
    from clawflow.envs.terminal import TerminalEnv, load_tasks

    envs: list[Environment] = []
    for name in cfg.envs.environments:
        if name == "persona":
            envs.append(PersonaEnv(load_personas(cfg.envs.personas_file, cfg.envs.personas), cfg.envs))
        elif name == "terminal":
            envs.append(TerminalEnv(load_tasks(cfg.envs.terminal_tasks_file), cfg.envs))
    return envs
