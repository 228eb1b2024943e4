# syntax=docker/dockerfile:1
# Multi-stage build: compile with the full Rust toolchain (protoc is vendored
# by a crate; librdkafka and the OpenSSL it uses for Kafka SSL/SASL are built
# from source by rdkafka-sys with the C toolchain and perl the image has, so
# the binary needs no libssl at run time; gRPC and Redis TLS are rustls),
# ship only the binary and the example rules on a slim Debian, as a non-root
# user. The examples are files to read or mount, never rules in force: the
# image serves the rules its configuration names (`rules.path`,
# `rules.envoy_path`, or upstream's `RUNTIME_ROOT` in compat mode), and
# refuses to start, naming those keys, when it names none.
#
# Both bases are build arguments so a release pins them by digest, resolved
# where a registry is reachable:
#   docker build \
#     --build-arg BUILD_IMAGE=rust:1.95-bookworm@sha256:<digest> \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim@sha256:<digest> .
# (`docker buildx imagetools inspect debian:bookworm-slim` prints the digest.)
ARG BUILD_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY . .
# The registry and the target dir are BuildKit cache mounts: a rebuild after
# a source change recompiles this crate only, not librdkafka, OpenSSL and
# the other dependencies. (The cached target dir is not in the layer, so
# the binary is copied out of it.)
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ratelimitd \
    && cp target/release/ratelimitd /usr/local/bin/ratelimitd

FROM ${RUNTIME_IMAGE}
# /bin/ratelimit: envoyproxy/ratelimit's path, which control planes (Envoy
# Gateway) run as the container's command; under that name the binary
# serves in envoyproxy compat mode. limitador-server (on the PATH):
# limitador's command, which Kuadrant's limitador-operator runs; under that
# name the binary takes limitador's command line.
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/ratelimitd ratelimitd \
    && ln -s /usr/local/bin/ratelimitd /bin/ratelimit \
    && ln -s /usr/local/bin/ratelimitd /usr/local/bin/limitador-server
COPY --from=build /usr/local/bin/ratelimitd /usr/local/bin/ratelimitd
COPY examples /etc/ratelimitd/examples
WORKDIR /var/lib/ratelimitd
# The state directory (dead-letter file and spool, local counts) whatever
# user runs the image: a control plane may run it as another user (Envoy
# Gateway: 65534, read-only root filesystem) with a volume mounted here.
ENV RATELIMITD__RULES__EXAMPLES=false \
    STATE_DIRECTORY=/var/lib/ratelimitd
USER ratelimitd
# gRPC (grpc.listen) and metrics/health (http.listen).
EXPOSE 8081 8080
# The binary's own probe of its /healthz: no curl in the image.
HEALTHCHECK --interval=10s --timeout=3s --retries=3 CMD ["ratelimitd", "probe", "--addr", "127.0.0.1:8080", "--path", "/healthz"]
ENTRYPOINT ["ratelimitd"]
CMD ["serve"]
