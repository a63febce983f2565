"""Rollout: inference engines, the multi-turn agent loop, and the pool that runs many episodes."""
