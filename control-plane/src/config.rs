//! The controller's configuration: command-line flags, each also readable
//! from an `SLUICE_*` environment variable, validated into a
//! [`ControllerConfig`] that cannot be invalid.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use sluice_policy::Millis;
use sluice_proto::tls::TlsFiles;
use tonic::transport::ServerTlsConfig;

use crate::auth::{AdminAccess, Tokens};

/// The controller's flags.
#[derive(Debug, Clone, Parser)]
#[command(name = "sluice-controller", version, about = "The sluice controller")]
pub struct Args {
    /// Address of the gRPC server (stage sessions and the admin API).
    #[arg(long, env = "SLUICE_GRPC_ADDR", default_value = "127.0.0.1:7070")]
    pub grpc_addr: String,
    /// Address of the HTTP server (REST view, /metrics, /healthz, /readyz).
    #[arg(long, env = "SLUICE_HTTP_ADDR", default_value = "127.0.0.1:7080")]
    pub http_addr: String,
    /// The store: `sqlite://PATH` (created if absent) or `postgres://...`.
    #[arg(
        long,
        env = "SLUICE_DATABASE_URL",
        default_value = "sqlite://sluice.db"
    )]
    pub database_url: String,
    /// How often the control loop recomputes and pushes settings (`1s`, `500ms`).
    #[arg(long, env = "SLUICE_TICK", default_value = "1s")]
    pub tick: String,
    /// A stage silent this long is marked lost (`5s`).
    #[arg(long, env = "SLUICE_STAGE_TIMEOUT", default_value = "5s")]
    pub stage_timeout: String,
    /// Policy file or directory of `*.yaml`/`*.yml` files applied at start.
    #[arg(long, env = "SLUICE_POLICIES")]
    pub policies: Option<PathBuf>,
    /// The gRPC server's certificate chain (PEM). With --tls-key and
    /// --tls-ca it turns on mutual TLS.
    #[arg(long, env = "SLUICE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "SLUICE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) that must have signed every client's
    /// certificate (stages and sluicectl).
    #[arg(long, env = "SLUICE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Admit a stage only under a stage id its client certificate names (a
    /// DNS subject alternative name equal to the id): with one certificate
    /// per stage, a stage cannot take another's id. Needs the --tls-* flags.
    #[arg(long, env = "SLUICE_BIND_STAGE_IDS")]
    pub bind_stage_ids: bool,
    /// Bearer tokens of the admin API (gRPC AdminService and /api/): one
    /// `ROLE TOKEN` line each, ROLE `admin` (may apply and delete) or `read`
    /// (may list, get and watch); `#` starts a comment line. Read again
    /// every 2s and on SIGHUP. Without it every caller is admin, which is
    /// allowed on loopback addresses only (see --insecure-admin).
    #[arg(long, env = "SLUICE_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Serve the admin API without --token-file on non-loopback addresses:
    /// anyone who reaches them may change every policy.
    #[arg(long, env = "SLUICE_INSECURE_ADMIN")]
    pub insecure_admin: bool,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Where the gRPC server listens.
    pub grpc_addr: SocketAddr,
    /// Where the HTTP server listens.
    pub http_addr: SocketAddr,
    /// The store's URL.
    pub database_url: String,
    /// The control loop's period.
    pub tick: Duration,
    /// Silence after which a stage is marked lost.
    pub stage_timeout: Duration,
    /// Policies applied at start.
    pub policies: Option<PathBuf>,
    /// Mutual TLS for the gRPC server (`None`: plain text).
    pub tls: Option<ServerTlsConfig>,
    /// Whether a stage's id must be named by its client certificate.
    pub bind_stage_ids: bool,
    /// Who may use the admin API.
    pub admin: AdminAccess,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct ConfigError {
    /// The flag at fault.
    pub flag: &'static str,
    /// What is wrong and what to write instead.
    pub reason: String,
}

impl ControllerConfig {
    /// Validates parsed flags.
    pub fn from_args(args: Args) -> Result<Self, ConfigError> {
        let grpc_addr = addr("--grpc-addr", &args.grpc_addr)?;
        let http_addr = addr("--http-addr", &args.http_addr)?;
        if grpc_addr == http_addr && grpc_addr.port() != 0 {
            return Err(ConfigError {
                flag: "--http-addr",
                reason: format!(
                    "`{http_addr}` is --grpc-addr too: give the admin HTTP API a port of its own, e.g. {}:7080",
                    http_addr.ip()
                ),
            });
        }
        let tls = server_tls(
            args.tls_cert.as_deref(),
            args.tls_key.as_deref(),
            args.tls_ca.as_deref(),
        )?;
        let (tick, stage_timeout) = periods(&args)?;
        if args.bind_stage_ids && tls.is_none() {
            return Err(ConfigError {
                flag: "--bind-stage-ids",
                reason: "a stage id is bound to the stage's client certificate, which needs \
                         mutual TLS: give --tls-cert, --tls-key and --tls-ca too"
                    .into(),
            });
        }
        if let Some(policies) = &args.policies
            && let Err(e) = std::fs::metadata(policies)
        {
            return Err(ConfigError {
                flag: "--policies",
                reason: format!("{}: {e}", policies.display()),
            });
        }
        Ok(Self {
            admin: admin_access(&args, grpc_addr, http_addr)?,
            grpc_addr,
            http_addr,
            database_url: args.database_url,
            tick,
            stage_timeout,
            policies: args.policies,
            tls,
            bind_stage_ids: args.bind_stage_ids,
        })
    }

    /// Returns a configuration for tests: ephemeral ports, the given store,
    /// a fast tick.
    pub fn for_tests(database_url: impl Into<String>) -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            database_url: database_url.into(),
            tick: Duration::from_millis(200),
            stage_timeout: Duration::from_secs(3),
            policies: None,
            tls: None,
            bind_stage_ids: false,
            admin: AdminAccess::Open,
        }
    }
}

/// Returns how the admin API admits callers: the tokens of --token-file;
/// without one, everyone, which needs loopback addresses or
/// --insecure-admin.
fn admin_access(
    args: &Args,
    grpc: SocketAddr,
    http: SocketAddr,
) -> Result<AdminAccess, ConfigError> {
    if let Some(path) = &args.token_file {
        let tokens = Tokens::read(path).map_err(|e| ConfigError {
            flag: "--token-file",
            reason: e.to_string(),
        })?;
        return Ok(AdminAccess::Tokens {
            path: path.clone(),
            tokens,
        });
    }
    let exposed = [("--grpc-addr", grpc), ("--http-addr", http)]
        .into_iter()
        .find(|(_, a)| !a.ip().is_loopback());
    match exposed {
        Some((flag, addr)) if !args.insecure_admin => Err(ConfigError {
            flag,
            reason: format!(
                "{addr} is not a loopback address and no --token-file is given, so anyone who \
                 reaches it could change every policy: give --token-file PATH (see \
                 docs/operations.md, \"Admin access\"), listen on 127.0.0.1, or pass \
                 --insecure-admin to accept that"
            ),
        }),
        _ => Ok(AdminAccess::Open),
    }
}

/// Reads the three TLS files into a server configuration that presents
/// `cert` and requires client certificates signed by `ca`; all three or
/// none.
fn server_tls(
    cert: Option<&Path>,
    key: Option<&Path>,
    ca: Option<&Path>,
) -> Result<Option<ServerTlsConfig>, ConfigError> {
    TlsFiles::read_all_or_none(cert, key, ca)
        .and_then(|files| files.map(TlsFiles::server).transpose())
        .map_err(|e| ConfigError {
            flag: e.flag,
            reason: e.reason,
        })
}

fn addr(flag: &'static str, value: &str) -> Result<SocketAddr, ConfigError> {
    value.parse().map_err(|_| ConfigError {
        flag,
        reason: format!("`{value}` is not an address: write IP:PORT, for example 127.0.0.1:7070"),
    })
}

/// Returns `--tick` and `--stage-timeout`: the control loop runs at least
/// once a minute and more often than stages are given up on, and a stage
/// (which reports every second) is given up on after two silent reports
/// at the earliest.
fn periods(args: &Args) -> Result<(Duration, Duration), ConfigError> {
    let tick = duration("--tick", &args.tick)?;
    let stage_timeout = duration("--stage-timeout", &args.stage_timeout)?;
    if tick > MAX_TICK {
        return Err(ConfigError {
            flag: "--tick",
            reason: format!(
                "`{}` is too long: the control loop must run at least once a minute",
                args.tick
            ),
        });
    }
    if stage_timeout < MIN_STAGE_TIMEOUT {
        return Err(ConfigError {
            flag: "--stage-timeout",
            reason: format!(
                "`{}` is under 2s: a stage that missed a few telemetry reports (it sends two a \
                 second) would be counted lost: give at least 2s",
                args.stage_timeout
            ),
        });
    }
    if tick >= stage_timeout {
        return Err(ConfigError {
            flag: "--tick",
            reason: format!(
                "`{}` is not shorter than --stage-timeout ({}): the control loop would notice a \
                 lost stage a tick late; make the tick shorter",
                args.tick, args.stage_timeout
            ),
        });
    }
    Ok((tick, stage_timeout))
}

/// The longest control loop period.
const MAX_TICK: Duration = Duration::from_secs(60);
/// The shortest time a silent stage is kept.
const MIN_STAGE_TIMEOUT: Duration = Duration::from_secs(2);

fn duration(flag: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let example = if flag == "--stage-timeout" {
        "5s"
    } else {
        "1s"
    };
    let millis = Millis::parse(value).map_err(|e| ConfigError {
        flag,
        reason: e.to_string(),
    })?;
    if millis.0 == 0 {
        return Err(ConfigError {
            flag,
            reason: format!("`{value}` is zero: write a positive duration such as `{example}`"),
        });
    }
    Ok(millis.duration())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<ControllerConfig, ConfigError> {
        let args = std::iter::once("sluice-controller").chain(extra.iter().copied());
        ControllerConfig::from_args(Args::try_parse_from(args).unwrap())
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.grpc_addr.to_string(), "127.0.0.1:7070");
        assert_eq!(c.http_addr.to_string(), "127.0.0.1:7080");
        assert_eq!(c.database_url, "sqlite://sluice.db");
        assert_eq!(c.tick, Duration::from_secs(1));
        assert_eq!(c.stage_timeout, Duration::from_secs(5));
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = parse(&["--tick", "0s"]).unwrap_err();
        assert_eq!(e.flag, "--tick");
        let e = parse(&["--stage-timeout", "5"]).unwrap_err();
        assert_eq!(e.flag, "--stage-timeout");
        let e = parse(&["--grpc-addr", "localhost"]).unwrap_err();
        assert_eq!(e.flag, "--grpc-addr");
        assert_eq!(parse(&["--tick", "250ms"]).unwrap().tick.as_millis(), 250);
        for (args, flag, says) in [
            (
                &["--tick", "1000000000s"][..],
                "--tick",
                "at least once a minute",
            ),
            (
                &["--stage-timeout", "500ms"][..],
                "--stage-timeout",
                "at least 2s",
            ),
            (
                &["--tick", "10s", "--stage-timeout", "5s"][..],
                "--tick",
                "not shorter than --stage-timeout",
            ),
            (
                &["--stage-timeout", "0s"][..],
                "--stage-timeout",
                "such as `5s`",
            ),
            (
                &[
                    "--grpc-addr",
                    "127.0.0.1:7070",
                    "--http-addr",
                    "127.0.0.1:7070",
                ][..],
                "--http-addr",
                "is --grpc-addr too",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}");
            assert!(e.reason.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn an_open_admin_api_needs_loopback_or_insecure_admin() {
        assert!(matches!(parse(&[]).unwrap().admin, AdminAccess::Open));
        let e = parse(&["--grpc-addr", "0.0.0.0:7070"]).unwrap_err();
        assert_eq!(e.flag, "--grpc-addr");
        assert!(e.reason.contains("--insecure-admin"), "{e}");
        let e = parse(&["--http-addr", "10.1.2.3:7080"]).unwrap_err();
        assert_eq!(e.flag, "--http-addr");
        let c = parse(&["--grpc-addr", "0.0.0.0:7070", "--insecure-admin"]).unwrap();
        assert!(matches!(c.admin, AdminAccess::Open));
        let c = parse(&["--grpc-addr", "[::1]:7070"]).unwrap();
        assert!(matches!(c.admin, AdminAccess::Open));
    }

    /// Returns a temporary directory holding a file `name` with `text`,
    /// and the file's path.
    fn temp_file(name: &str, text: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        let path = file.to_str().unwrap().to_owned();
        (dir, path)
    }

    #[test]
    fn a_token_file_is_read_at_start() {
        let (_dir, file) = temp_file("tokens", "admin 0123456789abcdef0123\n");
        let path = file.as_str();
        let c = parse(&["--grpc-addr", "0.0.0.0:7070", "--token-file", path]).unwrap();
        let AdminAccess::Tokens { tokens, .. } = c.admin else {
            panic!("tokens expected");
        };
        assert_eq!(tokens.count(crate::auth::Role::Admin), 1);
        std::fs::write(&file, "root 0123456789abcdef0123\n").unwrap();
        let e = parse(&["--token-file", path]).unwrap_err();
        assert_eq!(e.flag, "--token-file");
        assert!(e.reason.contains(":1: unknown role `root`"), "{e}");
    }

    #[test]
    fn tls_flags_go_together_and_bad_files_are_named() {
        let (_dir, garbage) = temp_file("garbage.pem", "not pem");
        let garbage = garbage.as_str();
        let e = parse(&["--tls-cert", garbage, "--tls-ca", garbage]).unwrap_err();
        assert_eq!(e.flag, "--tls-key");
        assert!(e.to_string().contains("go together"), "{e}");
        let e = parse(&["--tls-key", garbage]).unwrap_err();
        assert_eq!(e.flag, "--tls-cert");
        let e = parse(&["--tls-cert", "/nonexistent/tls.crt", "--tls-key", garbage]).unwrap_err();
        assert_eq!(e.flag, "--tls-ca");
        let all = |cert: &str| {
            parse(&[
                "--tls-cert",
                cert,
                "--tls-key",
                garbage,
                "--tls-ca",
                garbage,
            ])
            .unwrap_err()
        };
        let e = all("/nonexistent/tls.crt");
        assert_eq!(e.flag, "--tls-cert");
        assert!(
            e.to_string().contains("cannot read /nonexistent/tls.crt"),
            "{e}"
        );
        let e = all(garbage);
        assert_eq!(e.flag, "--tls-cert");
        assert!(
            e.to_string()
                .contains(&format!("{garbage} is not a valid PEM file")),
            "{e}"
        );
    }
}
