# kvlens in a container: the project's own install on a slim Python base, run as a non-root user.
# The entry point is the kvlens CLI; deploy/compose.yaml gives each service its command (collectors,
# a periodic analyze, export). `kvlens serve` (one process for all of them) is not built yet: until
# it is, the compose file runs the commands it will supervise, one service each.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvlens \
    && mkdir -p /data && chown kvlens:kvlens /data

WORKDIR /opt/kvlens
COPY pyproject.toml README.md ./
COPY kvlens ./kvlens
COPY collector ./collector
COPY analyzers ./analyzers
COPY dashboards ./dashboards
COPY gpu_probe ./gpu_probe
COPY sample_data ./sample_data
RUN pip install .

USER kvlens
WORKDIR /data
VOLUME ["/data"]
# 9465: kvlens export; 9466: the event collector's /metrics; 4318: the OTLP/HTTP receiver
EXPOSE 9465 9466 4318
ENTRYPOINT ["kvlens"]
CMD ["--help"]
