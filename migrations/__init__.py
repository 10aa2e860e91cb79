"""Alembic migrations of the store (api/tables metadata); `sluice db upgrade` applies them."""
