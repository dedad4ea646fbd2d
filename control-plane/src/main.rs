//! `sluice-controller` binary: parse the configuration, bind, print the
//! ready line (with the role: `leader` or `standby`), serve until SIGTERM
//! or SIGINT (a second signal exits at once). SIGHUP re-reads
//! `--token-file`.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use sluice_controller::{Args, Controller, ControllerConfig};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let filter = match sluice_proto::log_filter::from_env("info") {
        Ok(filter) => filter,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "sluice-controller: invalid configuration: SLUICE_LOG: {e}"
            );
            return ExitCode::from(64);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log reader that went away (a restarted log shipper, `| head`)
        // costs log lines, not the controller: the default reports a failed
        // write on stderr, whose own failure panics.
        .log_internal_errors(false)
        .init();
    // A flag that does not parse is an invalid configuration too (64), as
    // a value that parses but is refused is; `--help` and `--version` exit 0.
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(64);
        }
    };
    let config = match ControllerConfig::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "sluice-controller: invalid configuration: {e}"
            );
            return ExitCode::from(64);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("building the tokio runtime");
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<sluice_controller::InvalidPolicies>() => {
            let _ = writeln!(std::io::stderr(), "sluice-controller: --policies: {e}");
            ExitCode::from(64)
        }
        Err(e) => match sluice_controller::configuration_error(&e) {
            Some(store) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "sluice-controller: --database-url: {}",
                    with_causes(store)
                );
                ExitCode::from(64)
            }
            None => {
                let _ = writeln!(
                    std::io::stderr(),
                    "sluice-controller: {}",
                    with_causes(e.as_ref())
                );
                ExitCode::FAILURE
            }
        },
    }
}

/// Returns `error: cause: cause...` on one line.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        // Some errors print their source in their own text already.
        let c_text = c.to_string();
        if !text.ends_with(&c_text) {
            text.push_str(&format!(": {c_text}"));
        }
        cause = c.source();
    }
    text
}

async fn run(config: ControllerConfig) -> anyhow::Result<()> {
    // Handlers first: a signal right after the ready line shuts down cleanly.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    // Opening the store can take a while (a Postgres server that does not
    // answer): a signal meanwhile ends the start.
    let controller = tokio::select! {
        controller = Controller::bind(config) => controller?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
    };
    let auth = controller.auth();
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reading the token file again");
            auth.reload_now();
        }
    });
    let addrs = controller.addresses()?;
    let role = if controller.is_leader() {
        "leader"
    } else {
        "standby"
    };
    let ready = serde_json::json!({
        "event": "ready",
        "grpc": addrs.grpc.to_string(),
        "http": addrs.http.to_string(),
        "role": role,
    });
    // A closed stdout costs the line, not the process (`println!` panics).
    let _ = writeln!(std::io::stdout(), "{ready}");
    tracing::info!(grpc = %addrs.grpc, http = %addrs.http, role, "controller listening");
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("signal received: shutting down (a second signal exits at once)");
        on_signal.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        std::process::exit(130);
    });
    controller.run(cancel).await
}
