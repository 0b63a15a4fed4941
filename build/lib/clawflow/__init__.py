"""clawflow: train a chat agent's weights from the conversations it serves."""

__version__ = "0.1.0"
