# One image for every Jet role; docker-compose.yml picks the role by command.
#   docker build -t jet .                                  # CPU torch (the default demo)
#   docker build -t jet --build-arg TORCH="torch" --build-arg EXTRAS="[vllm,deepspeed]" .   # GPU nodes
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ARG EXTRAS=""

WORKDIR /app
COPY pyproject.toml README.md ./
COPY jet ./jet
COPY queues ./queues
COPY workers ./workers
COPY trainer ./trainer
COPY configs ./configs
RUN pip install $TORCH && pip install ".$EXTRAS" \
    && useradd --create-home --uid 1000 jet && mkdir -p /app/.jet /app/runs && chown -R jet /app
USER jet
CMD ["jet", "--help"]
