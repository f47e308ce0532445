"""foldtune's service database: SQLAlchemy models, engine/session, Alembic migrations, and the small
data-access helpers runners use (db.queue: claims/heartbeats/stale work; db.trials; db.trainings;
db.keys; db.optuna_storage). No business logic lives here."""
