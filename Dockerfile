# The leasekeeper image: the worker, beat, Flower and the operator CLI (docker-compose.yml).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    LEASEKEEPER_VAR_DIR=/var/lib/leasekeeper
RUN useradd --create-home --uid 10001 leasekeeper \
    && install -d -o leasekeeper -g leasekeeper /var/lib/leasekeeper
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tasks ./tasks
COPY workers ./workers
COPY models ./models
COPY providers ./providers
RUN pip install '.[postgres,embedded]'
USER leasekeeper
VOLUME ["/var/lib/leasekeeper"]
CMD ["celery", "-A", "workers.app", "worker", "-E", "-l", "info"]
