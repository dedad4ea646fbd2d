# syntax=docker/dockerfile:1
# sluice-stage, the data-plane daemon. Build from the repository root:
#   docker build -f docker/stage.Dockerfile -t ghcr.io/sluice-dev/sluice-stage:0.1.0 .
#
# The builder and the runtime are both Debian 12 (bookworm), so the binary's
# glibc matches. The runtime is debian-slim rather than distroless because
# the Helm chart's init container uses its /bin/sh, chown and chmod to hand
# the trainer-socket host directory to the stage's user.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sluice-stage --bin sluice-stage \
 && install -D -m 0755 target/release/sluice-stage /out/sluice-stage

FROM debian:bookworm-slim
RUN groupadd --system --gid 65532 sluice \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin sluice
COPY --from=build /out/sluice-stage /usr/local/bin/sluice-stage
USER 65532:65532
# Trainers: UNIX socket (default path below) or TCP 7170 with --listen;
# /metrics, /healthz, /readyz on 7190.
ENV SLUICE_SOCKET=/run/sluice/stage.sock \
    SLUICE_METRICS_ADDR=0.0.0.0:7190
EXPOSE 7170 7190
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/sluice-stage"]
