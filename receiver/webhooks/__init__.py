"""The hot path, named after its route: ``POST /webhooks/...`` — reading the request within
bounds, verifying its signature, the per-route limits and the tenants' signed endpoints."""
