# Relay on the embedded PostgreSQL by default; set RELAY_DATABASE_URL to use
# your own server (and for several instances, which must share one database).
FROM python:3.11-slim

# The data volume's folder (RELAY_HOME, the embedded PostgreSQL's) is made here, owned by relay:
# Docker gives a new volume mounted there the folder's owner; without the folder, the mount point
# and the volume belong to root, and relay cannot create its database in it.
RUN useradd --create-home --uid 10001 relay \
 && install -d -o relay -g relay /home/relay/data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY workflows ./workflows
COPY protocol ./protocol
RUN pip install --no-cache-dir ./protocol .

USER relay
ENV RELAY_HOME=/home/relay/data \
    RELAY_CONFIG=/etc/relay/relay.yaml
VOLUME ["/home/relay/data"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz').status != 200)"
# --host "": every IPv4 and every IPv6 address (a socket for each family), for IPv6-only and
# dual-stack networks too.
CMD ["relay", "serve", "--host", "", "--port", "8080"]
