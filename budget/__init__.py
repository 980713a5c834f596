"""The database load budget: how much batch work may run on the players' database at once
(docs/budget.md). Platform level: the jobs and the Temporal layer use it; it imports only core."""
