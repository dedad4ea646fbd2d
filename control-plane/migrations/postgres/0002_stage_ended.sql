-- When a stage last ended its session itself (a stop, not a loss), until
-- its next hello: a leader that takes over meanwhile tells a stage that
-- left from one that was lost.
ALTER TABLE stages ADD COLUMN ended_ms BIGINT;
