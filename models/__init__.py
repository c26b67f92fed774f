"""The SQL lease store: typed models (schema.py), the store's operations (store.py), and
the Alembic migrations (migrations/)."""
