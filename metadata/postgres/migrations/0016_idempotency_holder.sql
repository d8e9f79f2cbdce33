-- An idempotency key's record names the server process that runs its call
-- ("<node>@<start, Unix ms>"; '' with one server, and for records from
-- before): a retry on another node waits for a call still running there and
-- takes over one whose server is gone.
ALTER TABLE idempotency_keys ADD COLUMN holder TEXT NOT NULL DEFAULT '';
