# Stand-ins for the public images the compose stack uses, built from Debian bookworm's
# packages on top of the stand-in base (scripts/docker/standins.sh), for machines that cannot
# reach the image registry. Each behaves as the real image does for docker-compose.yml: the
# same command-line interface, ports and data directories. Built with BuildKit (one target at
# a time; the classic builder would build every stage before the target).
ARG BASE=python:3.11-slim-bookworm

# redis:7.2-alpine: redis-server on 0.0.0.0:6379, data in /data, redis-cli for the healthcheck.
FROM ${BASE} AS redis
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o redis -g redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]

# oliver006/redis_exporter: REDIS_ADDR from the environment, metrics on :9121.
FROM ${BASE} AS redis-exporter
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      prometheus-redis-exporter \
 && rm -rf /var/lib/apt/lists/*
USER nobody
EXPOSE 9121
ENTRYPOINT ["/usr/bin/prometheus-redis-exporter", "-web.listen-address=:9121"]

# prom/prometheus: the binary as the entrypoint, /prometheus writable by its user.
FROM ${BASE} AS prometheus
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup /prometheus
WORKDIR /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
