"""`sluice keys`: tenants' API keys, created and revoked in the database."""

from __future__ import annotations

import argparse
import datetime
import sys

from sluice.worker.cli.common import UsageError, database


def add_parsers(commands) -> None:
    parser = commands.add_parser("keys", help="create and revoke tenants' API keys")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key (and the tenant, if new); prints the key last, once",
                                description="Create an API key for the tenant, creating the tenant if new. The key is "
                                            "printed as the last line and cannot be shown again: only its hash is "
                                            "stored.")
    create.add_argument("--tenant", required=True, metavar="NAME")
    create.set_defaults(handler=keys_create_command)
    revoke = actions.add_parser("revoke", help="revoke a key: it is refused from now on",
                                description="Revoke an API key: it is refused from now on. A key already revoked is "
                                            "left as it is and reported with the time it was revoked (exit code "
                                            "0); an unknown key is an error (exit code 2).")
    revoke.add_argument("key", metavar="KEY_ID_OR_PREFIX", help="the key's id (key_...) or printed prefix")
    revoke.set_defaults(handler=keys_revoke_command)


def keys_create_command(args: argparse.Namespace) -> int:
    from sluice.api import store

    try:
        with database() as session:
            tenant = store.get_or_create_tenant(session, args.tenant)
            row, key = store.create_api_key(session, tenant.id)
    except store.StoreError as e:
        raise UsageError(str(e)) from None
    print(f"sluice keys: created {row.id} (prefix {row.prefix}) for tenant {tenant.name!r}; the key is shown only "
          "now:", file=sys.stderr)
    print(key)
    return 0


def keys_revoke_command(args: argparse.Namespace) -> int:
    from sluice.api import store
    from sluice.api.store.tenants import KEY_PREFIX

    try:
        with database() as session:
            row = store.find_api_key(session, args.key)
            earlier = store.revoke_api_key(session, row.id)
    except store.NotFound as e:
        prefix = args.key[:len(KEY_PREFIX) + 4]
        if args.key.startswith(KEY_PREFIX) and args.key != prefix:  # the key itself: neither echoed nor stored
            raise UsageError(f"give the key's id (key_...) or its prefix ({prefix}), as `sluice keys create` printed "
                             "them, not the key itself") from None
        raise UsageError(str(e)) from None
    except store.StoreError as e:
        raise UsageError(str(e)) from None
    if earlier is not None:  # a no-op, not a failure (as `sluice db upgrade` at the latest schema): exit 0
        since = datetime.datetime.fromtimestamp(earlier, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        print(f"sluice keys: {row.id} (prefix {row.prefix}) has been revoked since {since}; nothing changed",
              file=sys.stderr)
        return 0
    print(f"sluice keys: revoked {row.id} (prefix {row.prefix})", file=sys.stderr)
    return 0
