"""Replay pods against a cluster with several placement policies (same core as the server)."""
