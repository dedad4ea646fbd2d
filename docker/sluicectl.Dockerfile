# syntax=docker/dockerfile:1
# sluicectl, the operators' CLI. Build from the repository root:
#   docker build -f docker/sluicectl.Dockerfile -t ghcr.io/sluice-dev/sluicectl:0.1.0 .
#   docker run --rm -e SLUICE_SERVER=http://controller:7070 ghcr.io/sluice-dev/sluicectl:0.1.0 get stages
#   docker run --rm -v "$PWD/policies:/p:ro" ghcr.io/sluice-dev/sluicectl:0.1.0 validate -f /p

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sluicectl --bin sluicectl \
 && install -D -m 0755 target/release/sluicectl /out/sluicectl

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/sluicectl /usr/local/bin/sluicectl
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/sluicectl"]
