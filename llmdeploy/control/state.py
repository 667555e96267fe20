"""The deployment's durable state: one SQLite file (WAL) per deployment, written by the daemon and the CLI.

Holds the last applied spec and traffic split, the revisions, an audit log of events, and the engine
processes (pid + port) a restarted daemon may re-adopt. Specs are stored as validated by the schema, which
has no field for a secret: keys come from env vars (stored by name) or as sha256 hashes; generated keys are
stored only as their hashes.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deployment (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    name TEXT NOT NULL,
    spec TEXT,                                  -- last applied spec (JSON)
    stable INTEGER,                             -- revision ids
    candidate INTEGER,
    candidate_percent REAL NOT NULL DEFAULT 0,
    key_hashes TEXT NOT NULL DEFAULT '{}',      -- generated keys: name -> sha256:<hex>
    running INTEGER NOT NULL DEFAULT 0,         -- desired: 1 after apply, 0 after down
    daemon_pid INTEGER,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS revisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    spec TEXT NOT NULL,
    spec_hash TEXT NOT NULL,                    -- hash of what makes a revision: model, engine, parallel
    created REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    origin TEXT NOT NULL DEFAULT 'apply',
    served INTEGER NOT NULL DEFAULT 0           -- was the stable revision at some point (a rollback target)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    revision INTEGER,
    message TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS engines (
    revision INTEGER NOT NULL,
    replica TEXT NOT NULL,
    pid INTEGER NOT NULL,
    port INTEGER NOT NULL,
    started REAL NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0,        -- kept across daemons: a re-adopted engine keeps its count
    PRIMARY KEY (revision, replica)
);
"""
# version -> statements taking the previous version to it
MIGRATIONS: dict[int, list[str]] = {
    2: ["ALTER TABLE engines ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0"],
}


@dataclass(frozen=True)
class Deployment:
    name: str
    spec: dict[str, Any] | None
    stable: int | None
    candidate: int | None
    candidate_percent: float
    key_hashes: dict[str, str]
    running: bool
    daemon_pid: int | None
    updated: float


@dataclass(frozen=True)
class Revision:
    id: int
    spec: dict[str, Any]
    spec_hash: str
    created: float
    state: str
    reason: str
    origin: str
    served: bool


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    revision: int | None
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class EngineRecord:
    revision: int
    replica: str
    pid: int
    port: int
    started: float
    restarts: int = 0


class StateStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=30000")
        self.path.chmod(0o600)
        self._migrate()

    def close(self) -> None:
        self.db.close()

    def _migrate(self) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            for stmt in filter(str.strip, SCHEMA.split(";")):
                self.db.execute(stmt)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row else SCHEMA_VERSION
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for stmt in MIGRATIONS.get(v, []):
                    self.db.execute(stmt)
            self.db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    # deployment row
    def deployment(self) -> Deployment | None:
        r = self.db.execute("SELECT * FROM deployment WHERE id = 1").fetchone()
        if r is None:
            return None
        return Deployment(
            name=r["name"],
            spec=json.loads(r["spec"]) if r["spec"] else None,
            stable=r["stable"],
            candidate=r["candidate"],
            candidate_percent=r["candidate_percent"],
            key_hashes=json.loads(r["key_hashes"]),
            running=bool(r["running"]),
            daemon_pid=r["daemon_pid"],
            updated=r["updated"],
        )

    def ensure_deployment(self, name: str) -> Deployment:
        self.db.execute(
            "INSERT OR IGNORE INTO deployment (id, name, updated) VALUES (1, ?, ?)", (name, time.time())
        )
        return self.deployment()  # type: ignore[return-value]

    def update_deployment(self, **fields: Any) -> None:
        allowed = {"spec", "stable", "candidate", "candidate_percent", "key_hashes", "running", "daemon_pid"}
        unknown = set(fields) - allowed
        assert not unknown, f"unknown deployment fields {unknown}"
        values = {
            k: json.dumps(v, sort_keys=True) if k in ("spec", "key_hashes") and v is not None else v
            for k, v in fields.items()
        }
        values["updated"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in values)
        self.db.execute(f"UPDATE deployment SET {cols} WHERE id = 1", tuple(values.values()))

    # revisions
    def create_revision(self, spec: dict[str, Any], spec_hash: str, state: str, origin: str = "apply") -> int:
        cur = self.db.execute(
            "INSERT INTO revisions (spec, spec_hash, created, state, origin) VALUES (?, ?, ?, ?, ?)",
            (json.dumps(spec, sort_keys=True), spec_hash, time.time(), state, origin),
        )
        return int(cur.lastrowid)

    def set_revision_state(self, revision: int, state: str, reason: str | None = None) -> None:
        if reason is None:
            self.db.execute("UPDATE revisions SET state = ? WHERE id = ?", (state, revision))
        else:
            self.db.execute(
                "UPDATE revisions SET state = ?, reason = ? WHERE id = ?", (state, reason, revision)
            )

    def mark_served(self, revision: int) -> None:
        self.db.execute("UPDATE revisions SET served = 1 WHERE id = ?", (revision,))

    def revision(self, revision: int) -> Revision | None:
        r = self.db.execute("SELECT * FROM revisions WHERE id = ?", (revision,)).fetchone()
        return _revision(r) if r else None

    def revisions(self) -> list[Revision]:
        return [_revision(r) for r in self.db.execute("SELECT * FROM revisions ORDER BY id")]

    # events: the audit log
    def add_event(
        self, kind: str, message: str, revision: int | None = None, data: dict | None = None
    ) -> Event:
        ts = time.time()
        cur = self.db.execute(
            "INSERT INTO events (ts, kind, revision, message, data) VALUES (?, ?, ?, ?, ?)",
            (ts, kind, revision, message, json.dumps(data or {}, sort_keys=True)),
        )
        return Event(int(cur.lastrowid), ts, kind, revision, message, data or {})

    def events(self, limit: int = 20, kind: str | None = None) -> list[Event]:
        """The newest `limit` events, oldest first."""
        where, args = ("WHERE kind = ?", (kind,)) if kind else ("", ())
        rows = self.db.execute(
            f"SELECT * FROM events {where} ORDER BY id DESC LIMIT ?", (*args, limit)
        ).fetchall()
        return [
            Event(r["id"], r["ts"], r["kind"], r["revision"], r["message"], json.loads(r["data"]))
            for r in reversed(rows)
        ]

    # engine processes a restarted daemon may re-adopt
    def record_engine(self, revision: int, replica: str, pid: int, port: int, restarts: int = 0) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO engines (revision, replica, pid, port, started, restarts) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (revision, replica, pid, port, time.time(), restarts),
        )

    def forget_engine(self, revision: int, replica: str) -> None:
        self.db.execute("DELETE FROM engines WHERE revision = ? AND replica = ?", (revision, replica))

    def engines(self, revision: int | None = None) -> list[EngineRecord]:
        if revision is None:
            rows = self.db.execute("SELECT * FROM engines ORDER BY revision, replica")
        else:
            rows = self.db.execute("SELECT * FROM engines WHERE revision = ? ORDER BY replica", (revision,))
        return [
            EngineRecord(r["revision"], r["replica"], r["pid"], r["port"], r["started"], r["restarts"])
            for r in rows
        ]


def _revision(r: sqlite3.Row) -> Revision:
    return Revision(
        r["id"],
        json.loads(r["spec"]),
        r["spec_hash"],
        r["created"],
        r["state"],
        r["reason"],
        r["origin"],
        bool(r["served"]),
    )
