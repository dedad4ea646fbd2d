# syntax=docker/dockerfile:1
# sluice-controller, the control-plane daemon. Build from the repository root:
#   docker build -f docker/controller.Dockerfile -t ghcr.io/sluice-dev/sluice-controller:0.1.0 .
#
# SQLite is compiled in (sqlx bundles it), so the runtime needs only glibc
# and libgcc: distroless "cc" on Debian 12, matching the bookworm builder,
# running as its built-in non-root user 65532.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sluice-controller --bin sluice-controller \
 && install -D -m 0755 target/release/sluice-controller /out/sluice-controller

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/sluice-controller /usr/local/bin/sluice-controller
USER 65532:65532
# gRPC (stage sessions, admin API) and HTTP (REST, /metrics, /healthz, /readyz);
# the store defaults to a file under /var/lib/sluice (mount a volume there).
ENV SLUICE_GRPC_ADDR=0.0.0.0:7070 \
    SLUICE_HTTP_ADDR=0.0.0.0:7080 \
    SLUICE_DATABASE_URL=sqlite:///var/lib/sluice/sluice.db
WORKDIR /var/lib/sluice
EXPOSE 7070 7080
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/sluice-controller"]
