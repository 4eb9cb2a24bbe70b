"""The host loop: requests, slots, KV blocks, the draft schedule and the gate (see engine.py)."""
