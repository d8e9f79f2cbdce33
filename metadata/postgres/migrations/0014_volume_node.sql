-- Volumes record the node whose data directory holds them (the node that
-- created them): sandboxes that mount one are placed only there. Records
-- from before have no node ('').
ALTER TABLE volumes ADD COLUMN node TEXT NOT NULL DEFAULT '';
