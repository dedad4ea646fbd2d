-- sluice controller store, PostgreSQL. Times are Unix milliseconds (BIGINT,
-- as in the SQLite schema); labels are JSONB objects.

-- Every revision of every policy document, never rewritten. A policy's
-- current state is its highest revision; a NULL canonical text records a
-- delete (tombstone). Writers take LOCK TABLE ... SHARE ROW EXCLUSIVE, so
-- applies are serialized while reads go on.
CREATE TABLE policy_revisions (
    kind       TEXT   NOT NULL CHECK (length(kind) BETWEEN 1 AND 253),
    name       TEXT   NOT NULL CHECK (length(name) BETWEEN 1 AND 253),
    revision   BIGINT NOT NULL CHECK (revision > 0),
    canonical  TEXT,
    created_ms BIGINT NOT NULL,
    PRIMARY KEY (kind, name, revision)
);

CREATE TABLE stages (
    id               TEXT   NOT NULL PRIMARY KEY,
    node             TEXT   NOT NULL,
    labels           JSONB  NOT NULL,
    state            TEXT   NOT NULL CHECK (state IN ('connected', 'lost')),
    first_seen_ms    BIGINT NOT NULL,
    last_seen_ms     BIGINT NOT NULL,
    -- The last settings version allocated for this stage: only ever grows.
    settings_version BIGINT NOT NULL DEFAULT 0 CHECK (settings_version >= 0),
    desired_version  BIGINT,
    desired_settings TEXT,
    acked_version    BIGINT,
    nack_version     BIGINT,
    nack_reason      TEXT,
    CHECK ((desired_version IS NULL) = (desired_settings IS NULL)),
    CHECK ((nack_version IS NULL) = (nack_reason IS NULL))
);

CREATE TABLE jobs (
    id            TEXT   NOT NULL PRIMARY KEY,
    labels        JSONB  NOT NULL,
    first_seen_ms BIGINT NOT NULL,
    last_seen_ms  BIGINT NOT NULL
);

-- Which stages reported a trainer of which job.
CREATE TABLE job_stages (
    job_id       TEXT   NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    stage_id     TEXT   NOT NULL REFERENCES stages (id) ON DELETE CASCADE,
    last_seen_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, stage_id)
);

-- A sequence would hand out seqs in one order and commit them in another,
-- and a watcher reading "seq > last" would skip the late committer. The
-- single counter row is locked by each append until it commits instead, so
-- seq order is commit order (events are rare; the lock is cheap).
CREATE TABLE event_counter (
    singleton BOOLEAN NOT NULL PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    last_seq  BIGINT  NOT NULL
);
INSERT INTO event_counter (last_seq) VALUES (0);

CREATE TABLE events (
    seq         BIGINT NOT NULL PRIMARY KEY,
    kind        TEXT   NOT NULL,
    subject     TEXT   NOT NULL,
    message     TEXT   NOT NULL,
    unix_millis BIGINT NOT NULL
);
