"""Agent environments shipped with agentrl, importable as ``agentrl.envs.<name>``."""
