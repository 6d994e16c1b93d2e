# One image for every specfleet process; the command picks the role:
#   specfleet worker (default) · specfleet run CONFIG · celery -A workers flower · specfleet exporter
#   · specfleet simulate.  No secret is ever baked in: REDIS_URL, OPENROUTER_API_KEY come at run time.
FROM python:3.11-slim

# DL3064 flags TOKENIZERS_PARALLELISM for its name; it is a switch, not a secret.
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # Tokenizers are downloaded here; compose/k8s mount a volume so replicas share one copy.
    HF_HOME=/cache/huggingface \
    # Explicit, as tokenizers warns otherwise; workers encode in gevent's threadpool instead.
    TOKENIZERS_PARALLELISM=false \
    MPLBACKEND=Agg

# Dependencies first, exactly as locked (uv.lock: every transitive dependency, with its hashes), the
# same versions `make install` and CI test: this layer is reused until the lock changes. uv only
# writes the runtime part of the lock out (offline); pip installs it and checks every hash.
ARG UV_VERSION=0.13.8
COPY pyproject.toml uv.lock /src/
RUN pip install "uv==${UV_VERSION}" \
    && uv export --project /src --frozen --no-dev --no-emit-project --format requirements-txt -o /tmp/requirements.txt \
    && pip uninstall -y uv \
    && pip install --no-deps --require-hashes -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY common /src/common
COPY workers /src/workers
COPY producer /src/producer
COPY simulator /src/simulator
RUN pip install --no-deps /src && rm -rf /src
# The producer's entrypoint in compose.yaml: creates /out for the user who owns the run's files.
COPY ops/docker/as-owner /usr/local/bin/specfleet-as-owner

# A fixed uid so bind mounts can be chowned to it (or the producer run as the host user: compose
# sets `user:` from SPECFLEET_UID). /data: Flower's state; /out: the producer's rows.
RUN groupadd --system --gid 10001 specfleet \
    && useradd --system --uid 10001 --gid specfleet --create-home --home-dir /home/specfleet specfleet \
    && mkdir -p /data /out /config /cache/huggingface \
    && chown -R specfleet:specfleet /data /out /cache
# Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
WORKDIR /home/specfleet
# matplotlib builds its font cache on first import (~14 s): once here, not in every new container.
RUN python -c "import matplotlib.pyplot"

# The default role is the worker: healthy while its own node (specfleet@<this hostname>)
# answers a ping. Other roles override this in compose.yaml / the k8s manifests.
HEALTHCHECK --interval=60s --timeout=30s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import socket, sys; from workers.celery import app; r = app.control.inspect(timeout=15, limit=1, pattern='*@' + socket.gethostname(), matcher='glob').ping(); sys.exit(0 if r else 1)"]

# Exec form, and `specfleet worker` exec's celery: celery itself gets SIGTERM (no shell between),
# so a stop is a warm shutdown that lets in-flight requests finish.
CMD ["specfleet", "worker"]
