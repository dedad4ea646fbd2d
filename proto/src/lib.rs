//! The sluice gRPC protocol, generated at build time from
//! `proto/sluice/v1/*.proto` with prost and tonic. [`v1::StageMessage`] and
//! [`v1::ControllerMessage`] travel on the `StageService.Session` stream that
//! every stage keeps open to the controller (hello, telemetry, versioned
//! settings, ack/nack); [`AdminService`] is the operators' API that
//! `sluicectl` calls. The types here are wire types only: each service
//! converts them to its domain types at its edge.

/// Package `sluice.v1`: every message, enum and service of the protocol.
///
/// Each service `FooService` comes with a `foo_service_server` module (the
/// `FooService` trait to implement and the `FooServiceServer` wrapper to
/// register with `tonic::transport::Server`) and a `foo_service_client`
/// module (`FooServiceClient`). A `oneof` named `kind` in `Foo` is the enum
/// `foo::Kind`.
pub mod v1 {
    tonic::include_proto!("sluice.v1");
}

pub mod fd_limit;
pub mod listen;
pub mod log_filter;
pub mod tls;

/// Returns an error with its sources, `: `-separated: a tonic transport
/// error's own message is only "transport error". A source whose message
/// the chain already holds (an error that quotes its source) is not
/// repeated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !out.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        source = s.source();
    }
    out
}

pub use v1::admin_service_client::AdminServiceClient;
pub use v1::admin_service_server::{AdminService, AdminServiceServer};
pub use v1::stage_service_client::StageServiceClient;
pub use v1::stage_service_server::{StageService, StageServiceServer};

#[cfg(test)]
mod tests;
