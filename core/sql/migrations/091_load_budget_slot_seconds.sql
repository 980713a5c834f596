-- The seconds budget slots were held in the current adjustment window (budget/controller.py): every
-- slot's, a claim's chunks included, and the batches' that charge rows. Their ratio scales the
-- batches' latency to the slot time an account takes in all (its claim and its cleanup), so the
-- in-flight limit that delivers a rate counts every statement an account holds a slot for.
ALTER TABLE load_budget
    ADD COLUMN window_slot_seconds  double precision NOT NULL DEFAULT 0,
    ADD COLUMN window_batch_seconds double precision NOT NULL DEFAULT 0;
