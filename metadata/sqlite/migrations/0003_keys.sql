-- Reserved for the API keys' table (branch keys); this file is replaced by
-- that branch's migration 0003 when both are merged.
SELECT 1;
