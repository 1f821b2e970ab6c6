# kvlens in a container: the project's own install on a slim Python base, run as a non-root user.
# The entry point is the kvlens CLI; its default command is `kvlens serve` over /data/kvlens.toml (the
# whole fleet in one supervised process). deploy/compose.yaml still gives each service its own
# command (collectors, a periodic analyze, export), which override it.
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
# 9465: kvlens export; 9466: the event collector's /metrics; 4318: the OTLP/HTTP receiver;
# 9467: kvlens serve's own /metrics
EXPOSE 9465 9466 4318 9467
ENTRYPOINT ["kvlens"]
CMD ["serve", "--config", "/data/kvlens.toml", "--lake", "/data/lake", "--db", "/data/kvlens.duckdb", "--host", "0.0.0.0", "--otlp-listen", "0.0.0.0:4318", "--metrics-port", "9467"]
