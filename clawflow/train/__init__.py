"""Training: pure loss functions (`loss`), the batch format (`batch`), the torchrun recipe
(`recipe`) and the launcher that runs it as a subprocess (`launch`)."""
