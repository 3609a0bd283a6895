"""How clients address a model: the one rule, shared by the launcher (vLLM's ``--served-model-name``) and the host
scripts (``make up`` prints it). Standard library only: ``make up`` runs it with the host's bare python3."""

from __future__ import annotations

from pathlib import Path


def served_name(model: str) -> str:
    """Clients address a local checkpoint by its folder name, a hub model by its id."""
    local = model.startswith(("/", ".")) or Path(model).is_dir()
    return Path(model).name if local else model
