-- Outbox delivery: leases so that several relays never send the same event at the same time, and a
-- dead-letter state that keeps the provider's answer. Additive only (001 stays as it landed).

ALTER TABLE outbox
    -- Who holds the event right now and until when. A relay that dies leaves a lease that simply
    -- expires; the next claim after `leased_until` takes the event over. lease_owner is unique per
    -- claim, so it doubles as a fencing token for recording outcomes.
    ADD COLUMN lease_owner     text,
    ADD COLUMN leased_until    timestamptz,
    ADD COLUMN last_attempt_at timestamptz,
    ADD COLUMN last_http_status integer,
    -- Dead letter: why the event will not be retried (the provider's answer, or "gave up after N").
    ADD COLUMN dead_at         timestamptz,
    ADD COLUMN dead_reason     text,
    -- How many times an operator asked for a redelivery (`starter.py outbox redeliver KEY`).
    ADD COLUMN redeliveries    integer NOT NULL DEFAULT 0;

-- Added NOT VALID, then validated: the VALIDATE scans the table under a lock that lets writes go on.
ALTER TABLE outbox ADD CONSTRAINT outbox_dead_has_reason
    CHECK (status <> 'dead' OR dead_reason IS NOT NULL) NOT VALID;
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_dead_has_reason;

-- Operators list the dead letters; relays look at nothing but the pending index from 001.
CREATE INDEX outbox_dead_idx ON outbox (dead_at) WHERE status = 'dead';
