"""``nopoll submit``: creating background responses and batches at a provider."""
