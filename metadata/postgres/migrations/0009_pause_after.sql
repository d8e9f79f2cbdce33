-- The paused standby tier: after pause_after_s idle seconds a running
-- sandbox is paused (0 = never; every sandbox before this migration).
ALTER TABLE sandboxes ADD COLUMN pause_after_s INTEGER NOT NULL DEFAULT 0;
