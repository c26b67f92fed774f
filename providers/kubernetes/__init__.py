"""The ``kubernetes`` provider: a lease is a Sandbox custom resource or a batch Job, plus a
per-run Secret ``<name>-env`` owned by it.

Where things live:
    manifests.py  pure builders (names, labels, Sandbox / Job / Secret manifests); no I/O
    status.py     pure readings of API objects (Sandbox readiness, Job phase, pod choice)
    errors.py     the one boundary translating ApiException / urllib3 errors into ours
    client.py     the only module that talks to the API server (typed ``KubeApi``)
    waits.py      readiness waits: one resumable watch under a monotonic deadline
    delivery.py   a warm pool claim's exec: the fixed script and its stdin (the run's data)
    provider.py   ``KubernetesProvider`` (acquire, resume_check, claim, job_exit, destroy,
                  list_managed)

Importing this package has no side effects: configuration is loaded only by
``provider.build_kubernetes_provider(settings)``.
"""
