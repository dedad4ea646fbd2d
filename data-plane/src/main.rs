//! `sluice-stage` binary: parse the configuration, bind, print the ready
//! line, serve until SIGTERM, SIGINT or SIGHUP (a second signal exits at once).

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use sluice_stage::{Args, ConfigError, Stage, StageConfig};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // object_store logs every retry at info: thousands of lines a second
    // while a store throttles (the metrics count them).
    let filter = match sluice_proto::log_filter::from_env("info,object_store=warn") {
        Ok(filter) => filter,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "sluice-stage: invalid configuration: SLUICE_LOG: {e}"
            );
            return ExitCode::from(64);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log reader that went away (a restarted log shipper, `| head`)
        // costs log lines, not the stage: the default reports a failed
        // write on stderr, whose own failure panics.
        .log_internal_errors(false)
        .init();
    // A flag that does not parse is an invalid configuration too (64), as
    // its YAML and environment forms are; `--help` and `--version` exit 0.
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(64);
        }
    };
    let config = match StageConfig::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "sluice-stage: invalid configuration: {e}"
            );
            return ExitCode::from(64);
        }
    };
    let no_threads = |why: &dyn std::fmt::Display| {
        let _ = writeln!(
            std::io::stderr(),
            "sluice-stage: cannot start its threads ({why}): raise the process's or pod's thread limit (RLIMIT_NPROC, the pod's pids limit)"
        );
    };
    // The runtime panics when the OS refuses it a worker thread after it
    // started another; unwinding then waits on that thread for good. Any
    // panic while it is built ends the stage at once instead.
    let reported = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        no_threads(&info.payload_as_str().unwrap_or("a panic"));
        std::process::exit(1);
    }));
    let built = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("stage-io")
        .build();
    std::panic::set_hook(reported);
    let runtime = match built {
        Ok(runtime) => runtime,
        Err(e) => {
            no_threads(&e);
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<ConfigError>().is_some() => {
            let _ = writeln!(
                std::io::stderr(),
                "sluice-stage: invalid configuration: {e:#}"
            );
            ExitCode::from(64)
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "sluice-stage: {e:#}");
            ExitCode::FAILURE
        }
    };
    // A storage read stuck in a hung file system (a filer that stopped
    // answering) must not hold the exit: its trainer already has an error.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    code
}

async fn run(config: StageConfig) -> anyhow::Result<()> {
    // Handlers first: a signal that arrives right after the ready line must
    // shut down cleanly, not take the default action.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    // A closed terminal or a supervisor's SIGHUP: drain as for SIGTERM
    // (the default action would end the stage with no drain).
    let mut hup = signal(SignalKind::hangup())?;
    let stage = Stage::bind(config).await?;
    let addrs = stage.addresses()?;
    // One JSON line on stdout tells scripts and tests where the stage listens.
    let ready = serde_json::json!({
        "event": "ready",
        "socket": addrs.socket,
        "tcp": addrs.tcp.map(|a| a.to_string()),
        "metrics": addrs.metrics.to_string(),
        "mount": addrs.mount,
    });
    // A closed stdout costs the line, not the process (`println!` panics).
    let _ = writeln!(std::io::stdout(), "{ready}");
    tracing::info!(socket = %addrs.socket.display(), metrics = %addrs.metrics, "stage ready");
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    let mount = addrs.mount.clone();
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {}, _ = hup.recv() => {} }
        tracing::info!("signal received: shutting down (a second signal exits at once)");
        on_signal.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {}, _ = hup.recv() => {} }
        // Ctrl-C in a shell whose script then stops the stage too is two
        // signals: the mount goes all the same.
        if let Some(dir) = &mount {
            sluice_stage::detach_at_exit(dir);
        }
        std::process::exit(130);
    });
    stage.run(cancel).await
}
