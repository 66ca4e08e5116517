"""Transports (ZeroMQ, WebRTC); installed as ``aurora.transport``."""
