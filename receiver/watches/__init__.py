"""Watches: results nopoll polls for, one store with its keys and Lua transitions."""
