"""Completion feeds: the accounts' feeds nopoll follows instead of polling each id (the
holder of each account's feeds, their cursors and the streams to follow)."""
