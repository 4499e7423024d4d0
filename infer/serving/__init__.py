"""Serving: the asyncio front of the engine, the OpenAI-compatible HTTP app, and its command line."""
