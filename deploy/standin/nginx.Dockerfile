# Stand-in for nginx:1.28.0 (docker compose's gRPC proxy): Debian 12's nginx 1.22, which lacks the
# upstream `resolve` parameter, so it serves the static upstream of deploy/compose.host.yml only.
ARG BASE=posenc-standin/debian:bookworm
FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends nginx-light \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /dev/stderr /var/log/nginx/error.log
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
