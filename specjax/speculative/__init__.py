"""Speculative decoding: modes and configs, host drafters, in-step workers, the spec step."""
