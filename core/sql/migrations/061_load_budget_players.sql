-- Whether anyone but this service uses the database (core/budget.py, docs/budget.md): the commit
-- probe's objective protects the players, so it holds the work back only while some session other
-- than this service's is active. Each probe samples pg_stat_activity and records when it last saw
-- such a session (players_seen_at, per holder); the adjustment reads the latest sighting and records
-- its verdict (observed_players_present; NULL before the first adjustment).
ALTER TABLE load_budget_probes ADD COLUMN players_seen_at timestamptz;
ALTER TABLE load_budget ADD COLUMN observed_players_present boolean;
