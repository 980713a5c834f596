-- The seconds budget slots were held in the current adjustment window, a claim's chunks included
-- (budget/controller.py): over the accounts cleaned in the window, the slot time an account takes
-- in all (its claim and its cleanup), so the in-flight limit that delivers a rate counts every
-- statement an account holds a slot for, not the cleanup batch's latency alone.
ALTER TABLE load_budget ADD COLUMN window_slot_seconds double precision NOT NULL DEFAULT 0;
