"""Authentication: key files, and the trainer's seals on weight versions."""
