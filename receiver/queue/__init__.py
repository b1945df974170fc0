"""The queue between the web app and the worker: job names and payloads, the enqueue with
its dedupe Lua, Redis round trips, dead letters, and the seam over arq."""
