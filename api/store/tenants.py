"""Tenants and their API keys: keys are shown once and stored as sha256 hashes."""

from __future__ import annotations

import hashlib
import re
import secrets
import time

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from sluice.api.store.common import InvalidInput, NotFound, insert, new_id
from sluice.api.tables import ApiKey, Tenant

DEFAULT_TENANT = "local"  # who owns what the CLI submits when no --tenant is given
KEY_PREFIX = "sk-sluice-"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    if not TENANT_NAME.fullmatch(name):
        raise InvalidInput(f"tenant name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                           "letter or digit", "tenant")
    # ON CONFLICT: two first submissions of a new tenant at once both succeed
    session.execute(insert(session, Tenant).values(name=name, created_at=time.time())
                    .on_conflict_do_nothing(index_elements=["name"]))
    return session.scalars(select(Tenant).where(Tenant.name == name)).one()


def create_api_key(session: Session, tenant_id: int) -> tuple[ApiKey, str]:
    """A new key for the tenant: the row, and the key itself, which is not stored and cannot be shown again."""
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant {tenant_id} not found")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id=new_id("key_"), tenant_id=tenant_id, key_hash=_hash(key), prefix=key[:len(KEY_PREFIX) + 4],
                 created_at=time.time())
    session.add(row)
    session.flush()
    return row, key


def resolve_api_key(session: Session, key: str) -> tuple[Tenant, str] | None:
    """The tenant a key belongs to and the key's id, or None for an unknown or revoked key."""
    row = session.execute(select(Tenant, ApiKey.id).join(ApiKey, ApiKey.tenant_id == Tenant.id)
                          .where(ApiKey.key_hash == _hash(key), ApiKey.revoked_at.is_(None))).one_or_none()
    return None if row is None else (row[0], row[1])


def hold_live_key(session: Session, key_id: str) -> bool:
    """Whether the key is still not revoked, held so (FOR SHARE, PostgreSQL) until the transaction ends: a revoke
    waits for a write this transaction makes in the key's name, or that write sees the revoke."""
    return session.scalar(select(ApiKey.id).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                          .with_for_update(read=True)) is not None


def find_api_key(session: Session, key_id_or_prefix: str) -> ApiKey:
    """The key with this id (key_...) or this printed prefix (sk-sluice-XXXX); a prefix two keys share is refused."""
    keys = session.scalars(select(ApiKey).where((ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix))
                           .order_by(ApiKey.id)).all()
    if not keys:
        raise NotFound(f"API key {key_id_or_prefix} not found")
    if len(keys) > 1:
        raise InvalidInput(f"{key_id_or_prefix} is the prefix of {len(keys)} keys ({', '.join(k.id for k in keys)}); "
                           "give the key id", "key")
    return keys[0]


def revoke_api_key(session: Session, key_id: str) -> float | None:
    """Refuse the key from now on. Returns None when this call revoked it, or when it was revoked if it already was
    (nothing changes then); an unknown key raises NotFound."""
    revoked = session.execute(update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                              .values(revoked_at=time.time()).returning(ApiKey.id)).first()
    if revoked is not None:
        return None
    earlier = session.scalar(select(ApiKey.revoked_at).where(ApiKey.id == key_id))
    if earlier is None:
        raise NotFound(f"API key {key_id} not found")
    return earlier


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
