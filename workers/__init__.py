"""The Celery app, its typed settings, the beat schedule, the runtime and the operator CLI."""
