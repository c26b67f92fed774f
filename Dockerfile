# The leasekeeper image: the worker, beat, Flower, the migration and the operator CLI
# (docker-compose.yml, deploy/). BASE_IMAGE is any Debian bookworm image: upstream
# python:3.11-slim-bookworm, or (the tests, with no registry) a plain Debian base, on which
# Debian's own python3 (3.11) is installed first.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 LEASEKEEPER_VAR_DIR=/var/lib/leasekeeper \
    PATH=/opt/leasekeeper/bin:$PATH
RUN if ! command -v python3 >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/leasekeeper \
    && useradd --create-home --uid 10001 leasekeeper \
    && install -d -o leasekeeper -g leasekeeper /var/lib/leasekeeper
WORKDIR /app
# Dependencies first (their layer changes only with pyproject.toml), then the code.
COPY pyproject.toml ./
RUN touch README.md && pip install '.[postgres,embedded]' && pip uninstall -y leasekeeper
COPY README.md ./
COPY tasks ./tasks
COPY workers ./workers
COPY models ./models
COPY providers ./providers
RUN pip install --no-deps . && rm -rf build *.egg-info
USER leasekeeper
VOLUME ["/var/lib/leasekeeper"]
CMD ["celery", "-A", "workers.app", "worker", "-E", "-l", "info"]
