"""HTTP server: OpenAI and Anthropic APIs over the engine (starlette + hypercorn)."""
