"""Registered voices: reference clips a caller uploads once (``POST /v1/audio/voices``) and then names in ``voice``,
kept in a database so that they outlive a replica and every ingress replica sees them.

Contract: ``VoiceStore(url)``: a SQLAlchemy database (a SQLite file for one node; PostgreSQL, through psycopg 3, for
several ingress replicas); its one table is created if missing. Every method is synchronous and safe from several
threads (callers on an event loop use ``asyncio.to_thread``); each is one transaction. A voice belongs to its owner
(a digest of the caller's API key: ``omni_serve.api.guards.owner_of``): another owner's voice looks unknown.
- ``add(owner, name, samples, limit)``: stores the clip (24 kHz float32 samples); ``VoiceExists`` when the owner has a
  voice of that name, ``TooManyVoices`` when it has ``limit`` already.
- ``get(owner, name)``: the clip, or None; ``list(owner)``: the owner's ``VoiceInfo``s by name; ``delete(owner,
  name)``: whether one was deleted.
Why no migration framework (the job store has one): one table, created idempotently; a change to it will need one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa

from omni_serve.jobs.store import engine_url

SAMPLE_RATE = 24000
_metadata = sa.MetaData()
VOICES = sa.Table(
    "omni_serve_voices", _metadata,
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("audio", sa.LargeBinary, nullable=False),  # float32 little-endian, 24 kHz mono
)


class VoiceExists(Exception):
    pass


class TooManyVoices(Exception):
    pass


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    created_at: int
    seconds: float


class VoiceStore:
    def __init__(self, url: str):
        parsed = engine_url(url)
        if parsed.get_backend_name() == "sqlite":
            os.makedirs(os.path.dirname(os.path.abspath(parsed.database)), exist_ok=True)
            self.engine = sa.create_engine(parsed, connect_args={"timeout": 30, "check_same_thread": False})
        else:
            self.engine = sa.create_engine(parsed, pool_pre_ping=True)
        self._lock = threading.Lock()  # serializes an owner's count-then-insert on SQLite (PostgreSQL: see add)
        _metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def add(self, owner: str, name: str, samples: np.ndarray, limit: int) -> VoiceInfo:
        audio = np.asarray(samples, dtype="<f4").tobytes()
        info = VoiceInfo(name, int(time.time()), len(samples) / SAMPLE_RATE)
        with self._lock, self.engine.begin() as db:
            if db.dialect.name == "postgresql":  # one owner's adds in turn, so the limit holds across replicas
                db.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:owner))"), {"owner": owner})
            count = db.execute(sa.select(sa.func.count()).select_from(VOICES).where(VOICES.c.owner == owner)).scalar()
            exists = db.execute(sa.select(VOICES.c.name).where(VOICES.c.owner == owner, VOICES.c.name == name)).first()
            if exists is not None:
                raise VoiceExists(name)
            if count >= limit:
                raise TooManyVoices(name)
            db.execute(VOICES.insert().values(owner=owner, name=name, created_at=info.created_at,
                                              samples=len(samples), audio=audio))
        return info

    def get(self, owner: str, name: str) -> np.ndarray | None:
        with self.engine.connect() as db:
            row = db.execute(sa.select(VOICES.c.audio).where(VOICES.c.owner == owner, VOICES.c.name == name)).first()
        return None if row is None else np.frombuffer(row.audio, dtype="<f4").copy()

    def list(self, owner: str) -> list[VoiceInfo]:
        with self.engine.connect() as db:
            rows = db.execute(sa.select(VOICES.c.name, VOICES.c.created_at, VOICES.c.samples)
                              .where(VOICES.c.owner == owner).order_by(VOICES.c.name)).all()
        return [VoiceInfo(r.name, r.created_at, r.samples / SAMPLE_RATE) for r in rows]

    def delete(self, owner: str, name: str) -> bool:
        with self.engine.begin() as db:
            return db.execute(VOICES.delete().where(VOICES.c.owner == owner, VOICES.c.name == name)).rowcount > 0
