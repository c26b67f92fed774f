"""The lease console (`leasekeeper console`): server-rendered pages (Starlette + Jinja2) over
the store, behind the same basic auth as Flower; buttons act through tasks/operator.py."""
