"""`sluice db upgrade`: the schema migrations of SLUICE_DATABASE_URL."""

from __future__ import annotations

import argparse
import sys

from sluice.worker.cli.common import UsageError, make_db_engine


def add_parsers(commands) -> None:
    parser = commands.add_parser("db", help="manage the database of SLUICE_DATABASE_URL")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("upgrade", help="apply the schema migrations (safe to repeat)").set_defaults(
        handler=db_upgrade_command)



def db_upgrade_command(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from sluice.api import db

    engine = make_db_engine()
    try:
        db.upgrade(engine)
    except SQLAlchemyError as e:
        raise UsageError(f"cannot migrate {engine.url!r}: {e}") from None
    print(f"sluice db: {engine.url!r} is at the latest schema", file=sys.stderr)
    return 0

