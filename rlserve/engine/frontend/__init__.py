"""The caller's process: `LLM`, `AsyncLLM`, output processing, the clients of the engine core and what starts it."""
