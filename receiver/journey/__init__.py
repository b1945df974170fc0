"""Journeys: the compact trail of what happened to one response or batch (callbacks, fetch
tries, sink writes, dead letters), one store with its keys and Lua."""
