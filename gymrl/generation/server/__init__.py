"""The policy server's front: the OpenAI-compatible app over any engine, rendering prompts with
the chat template, parsing tool calls, the divergence watch, the run's sampling rules, the API key
and the announcement of the endpoint.

Of generation, may import: types.
"""
