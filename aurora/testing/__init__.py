"""Test machinery that is product code: simulated networks, in-memory transports."""
