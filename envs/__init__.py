"""Agent environments shipped with agentrl, importable as ``agentrl.envs.<name>``."""

from agentrl.env import register

register("bugfix-v0", entry_point="agentrl.envs.bugfix:BugfixEnv")
register("swe-v0", entry_point="agentrl.envs.swe:SweEnv")
