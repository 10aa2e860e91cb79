"""the requests' status indexes cover only the rows they are read for: running (by lease) and queued (by publish time)

Each of a request's status changes (claimed, finished) wrote an entry in both full indexes, and they grew with every
request ever run; partial ones take no entry when a request finishes and stay the size of the work in flight.
Building them reads the requests table once, under a lock that holds its writes (claims, results) back meanwhile:
seconds for millions of rows.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 13:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_requests_status_lease", table_name="requests")
    op.drop_index("ix_requests_status_published", table_name="requests")
    for name, column, status in (("ix_requests_running_lease", "lease_expires_at", "running"),
                                 ("ix_requests_queued_published", "published_at", "queued")):
        where = sa.text(f"status = '{status}'")
        op.create_index(name, "requests", [column], unique=False, postgresql_where=where, sqlite_where=where)


def downgrade() -> None:
    op.drop_index("ix_requests_queued_published", table_name="requests")
    op.drop_index("ix_requests_running_lease", table_name="requests")
    op.create_index("ix_requests_status_lease", "requests", ["status", "lease_expires_at"], unique=False)
    op.create_index("ix_requests_status_published", "requests", ["status", "published_at"], unique=False)
