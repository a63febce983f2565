"""agentrl: reinforcement learning for tool-using coding agents."""

__version__ = "0.1.0"
