"""``nopoll endpoint``: the signed callback endpoint of a tenant's account at a provider."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from receiver.cli._common import add_config_option, load


def _cmd_endpoint(args: argparse.Namespace) -> int:
    from receiver.config.accounts import tenant_provider
    from receiver.webhooks.tenants import endpoint_path, endpoint_token

    settings = load(args)
    path = endpoint_path(endpoint_token(settings, args.tenant, args.provider))
    print(path)
    if settings.public_url:
        print(settings.public_url + path)
    config = tenant_provider(settings, args.tenant, args.provider)
    if config is not None and not config.webhook_secrets:
        print(
            f"nopoll: note: tenant {args.tenant!r} has no webhook_secrets for "
            f"{args.provider!r}: the endpoint answers 404 until they are set",
            file=sys.stderr,
        )
    return 0


def register(sub: Any) -> None:
    """Add this module's commands to the ``nopoll`` parser."""
    p = sub.add_parser(
        "endpoint",
        help="print a tenant's signed callback endpoint for a provider",
        description="Print /webhooks/t/{token} for the tenant's account at the provider (and "
        "the full URL when public_url is set): the address to give the provider's webhook "
        "settings. The token is signed by the first of tenant_keys.",
    )
    add_config_option(p)
    p.add_argument("--tenant", required=True, help="a tenant name from tenants:")
    p.add_argument("--provider", required=True, help="a provider name from providers:")
    p.set_defaults(func=_cmd_endpoint)
