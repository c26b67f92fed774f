"""The Prometheus exporter (`leasekeeper metrics`): gauges read from the store, counters and
histograms derived from the store's append-only logs (lease events, sweep ticks) tailed by
id, and a worker-up gauge from a Celery ping. See collector.py for the metrics."""
