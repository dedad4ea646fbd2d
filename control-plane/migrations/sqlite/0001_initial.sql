-- sluice controller store, SQLite. Times are Unix milliseconds; labels are
-- JSON objects as text. STRICT tables make SQLite check column types.

-- Every revision of every policy document, never rewritten. A policy's
-- current state is its highest revision; a NULL canonical text records a
-- delete (tombstone).
CREATE TABLE policy_revisions (
    kind       TEXT    NOT NULL CHECK (length(kind) BETWEEN 1 AND 253),
    name       TEXT    NOT NULL CHECK (length(name) BETWEEN 1 AND 253),
    revision   INTEGER NOT NULL CHECK (revision > 0),
    canonical  TEXT,
    created_ms INTEGER NOT NULL,
    PRIMARY KEY (kind, name, revision)
) STRICT;

CREATE TABLE stages (
    id               TEXT    NOT NULL PRIMARY KEY,
    node             TEXT    NOT NULL,
    labels           TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('connected', 'lost')),
    first_seen_ms    INTEGER NOT NULL,
    last_seen_ms     INTEGER NOT NULL,
    -- The last settings version allocated for this stage: only ever grows.
    settings_version INTEGER NOT NULL DEFAULT 0 CHECK (settings_version >= 0),
    desired_version  INTEGER,
    desired_settings TEXT,
    acked_version    INTEGER,
    nack_version     INTEGER,
    nack_reason      TEXT,
    CHECK ((desired_version IS NULL) = (desired_settings IS NULL)),
    CHECK ((nack_version IS NULL) = (nack_reason IS NULL))
) STRICT;

CREATE TABLE jobs (
    id            TEXT    NOT NULL PRIMARY KEY,
    labels        TEXT    NOT NULL,
    first_seen_ms INTEGER NOT NULL,
    last_seen_ms  INTEGER NOT NULL
) STRICT;

-- Which stages reported a trainer of which job.
CREATE TABLE job_stages (
    job_id       TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    stage_id     TEXT    NOT NULL REFERENCES stages (id) ON DELETE CASCADE,
    last_seen_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, stage_id)
) STRICT;

-- AUTOINCREMENT never reuses a seq, and SQLite commits one writer at a
-- time, so seq order is commit order.
CREATE TABLE events (
    seq         INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    kind        TEXT    NOT NULL,
    subject     TEXT    NOT NULL,
    message     TEXT    NOT NULL,
    unix_millis INTEGER NOT NULL
) STRICT;
