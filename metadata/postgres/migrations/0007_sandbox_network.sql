-- A sandbox's egress policy (sandbox.Network) as a JSON object
-- {"internet_access": bool, "allow_out": [cidr...], "deny_out": [cidr...]};
-- NULL for every sandbox before this migration: no egress, as they had.
ALTER TABLE sandboxes ADD COLUMN network jsonb;
