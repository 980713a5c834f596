-- cleanup_claims rows are written only by the claims (claim_cohort, claim_account, claim_chunk), each
-- from the account rows the same statement has just locked and updated, so the foreign key to
-- accounts checked nothing the statement had not already made true. Its per-row trigger (a query
-- and a KEY SHARE lock of each account) was about a third of a claim chunk's time. It also kept
-- the game from deleting an account that had ever been claimed.
ALTER TABLE cleanup_claims DROP CONSTRAINT IF EXISTS cleanup_claims_account_id_fkey;
