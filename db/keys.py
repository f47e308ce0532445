"""Owners and their API keys. A key is ``ft_`` + 43 URL-safe random characters (256 bits); only its
SHA-256 is stored, so a leaked database does not leak usable keys. A plain hash (not a slow KDF) is
enough because the token is random, not a password."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.models import ApiKey, Owner, utcnow

TOKEN_PREFIX = "ft_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def get_or_create_owner(session: Session, name: str) -> Owner:
    """The owner called ``name``, created if new (not committed)."""
    owner = session.scalar(select(Owner).where(Owner.name == name))
    if owner is None:
        owner = Owner(name=name)
        session.add(owner)
        session.flush()
    return owner


def create_api_key(session: Session, owner_name: str) -> tuple[Owner, str]:
    """A new key for ``owner_name`` (creating the owner); returns the token, the only time it exists. Commits."""
    owner = get_or_create_owner(session, owner_name)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(owner_id=owner.id, key_hash=hash_token(token), prefix=token[:10]))
    session.commit()
    return owner, token


def owner_for_token(session: Session, token: str) -> Owner | None:
    """The owner of an unrevoked key equal to ``token``, else None."""
    return session.scalar(select(Owner).join(ApiKey, ApiKey.owner_id == Owner.id)
                          .where(ApiKey.key_hash == hash_token(token), ApiKey.revoked_at.is_(None)))


def revoke_keys(session: Session, owner_name: str) -> int:
    """Revoke every key of an owner; returns how many. Commits."""
    keys = session.scalars(select(ApiKey).join(Owner).where(Owner.name == owner_name,
                                                             ApiKey.revoked_at.is_(None))).all()
    for key in keys:
        key.revoked_at = utcnow()
    session.commit()
    return len(keys)
