-- The Temporal namespace of the workflow that claimed an account. Stranded-claim recovery asks
-- Temporal whether the claiming workflow is closed; that answer means something only in the
-- namespace that claimed, so a planner releases only its own namespace's claims. '' marks a claim
-- made before the namespace was recorded (a planner in any namespace may judge it, as before).
-- NOT NULL with a constant default: no table rewrite, and row comparisons stay total.
ALTER TABLE accounts ADD COLUMN IF NOT EXISTS claimed_namespace text NOT NULL DEFAULT '';

-- Recovery's skip scan: the distinct claiming workflows of one namespace's accounts in 'cleaning'.
CREATE INDEX IF NOT EXISTS accounts_cleaning_namespace_idx
    ON accounts (claimed_namespace, claimed_by) WHERE status = 'cleaning';
