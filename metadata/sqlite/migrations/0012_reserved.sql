-- Reserved: number 12 belongs to another branch's migration. This file only
-- keeps the numbers without a gap on this branch; it is dropped when that
-- migration is merged.
SELECT 1;
