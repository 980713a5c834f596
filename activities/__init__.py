"""Activity implementations: classes that receive the asyncpg pool in their constructor."""
