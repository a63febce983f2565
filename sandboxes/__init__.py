"""Sandbox backends shipped with agentrl, importable as ``agentrl.sandboxes.<name>``."""
