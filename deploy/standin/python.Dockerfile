# Stand-in for python:3.11-slim-bookworm, for machines that cannot pull from a registry
# (deploy/smoke.sh builds it on a Debian base made with debootstrap). Debian 12's Python is 3.11
# too; `python -m venv` is all the project's Dockerfile asks of its base.
# The build context is a folder smoke.sh fills: ca-certificates.crt is the host's bundle, so pip in
# the image trusts what the host trusts (a TLS-inspecting proxy's CA, say). Never used by the
# project's own Dockerfile.
ARG BASE=posenc-standin/debian:bookworm
FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
