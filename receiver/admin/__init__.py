"""The admin API (``/admin/...``): watches, submits and dead-letter operations."""
