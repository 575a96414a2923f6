# Stand-in for prom/prometheus:v2.55.1: Debian 12's Prometheus (2.42), with the official image's
# entrypoint, storage folder and user, and wget for the compose healthcheck.
ARG BASE=posenc-standin/debian:bookworm
FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown 65534:65534 /prometheus
USER 65534
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
