"""Role actors (trainer, relay, rollout); installed as ``aurora.actors``."""
