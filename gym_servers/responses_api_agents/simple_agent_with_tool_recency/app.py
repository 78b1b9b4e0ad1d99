"""Gym's compaction agent (`simple_agent_with_compaction`, unchanged) with the tool-output recency
policy registered (`tool_recency`), run by `ng_run` from Gym's venv like the wheel's agents
(gym_servers/README.md)."""

from responses_api_agents.simple_agent_with_compaction.app import SimpleAgentWithCompaction
from responses_api_agents.simple_agent_with_tool_recency.tool_recency import register

register()

if __name__ == "__main__":
    SimpleAgentWithCompaction.run_webserver()
