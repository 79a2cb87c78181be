"""Speculative decoding: the DSpark proposer (tensors, called by the runner) and the verification
policy (plain floats, called by the scheduler)."""
