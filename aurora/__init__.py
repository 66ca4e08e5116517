"""Aurora: RL post-training over ordinary networks with verified sparse weight deltas."""

__version__ = "0.1.0"
