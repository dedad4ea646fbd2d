//! Mutual TLS between stages and the controller, end to end with the real
//! binaries and certificates made at test time: a stage with a certificate
//! from the controller's CA runs its settings; a stage with a certificate
//! from another CA, and one speaking plain text, are refused while the
//! controller keeps serving the good one; sluicectl gets through with a
//! certificate too; half-given flags and bad PEM files stop the start with
//! a sentence naming the flag and the file. With `--bind-stage-ids` a stage
//! holding the CA's certificate for one id cannot take another's.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use sluice_proto::AdminServiceClient;
use sluice_proto::v1::ListStagesRequest;
use support::{acked_above, apply, controller_command, eventually, policy, stage_command, trainer};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A certificate authority and the certificates it signed, as PEM files
/// under one directory.
struct Authority {
    dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// The three files one party passes as `--tls-cert`, `--tls-key`,
/// `--tls-ca`.
struct Party {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl Party {
    fn args(&self) -> [String; 3] {
        [
            format!("--tls-cert={}", self.cert.display()),
            format!("--tls-key={}", self.key.display()),
            format!("--tls-ca={}", self.ca.display()),
        ]
    }
}

impl Authority {
    fn new(dir: &Path, name: &str) -> Self {
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} test CA"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.crt"), issuer.pem()).unwrap();
        Self { dir, issuer }
    }

    /// Signs a certificate for `names` (host names and IP addresses) and
    /// returns the files that present it and trust this authority.
    fn issue(&self, who: &str, names: &[&str]) -> Party {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        let party = Party {
            cert: self.dir.join(format!("{who}.crt")),
            key: self.dir.join(format!("{who}.key")),
            ca: self.dir.join("ca.crt"),
        };
        std::fs::write(&party.cert, cert.pem()).unwrap();
        std::fs::write(&party.key, key.serialize_pem()).unwrap();
        party
    }
}

/// An admin client presenting `party`'s certificate.
async fn admin(grpc: &str, party: &Party) -> AdminServiceClient<Channel> {
    let read = |p: &PathBuf| std::fs::read(p).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&party.ca)))
        .identity(Identity::from_pem(read(&party.cert), read(&party.key)));
    let channel = Endpoint::from_shared(format!("https://{grpc}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    AdminServiceClient::new(channel)
}

/// Waits until `log` holds `needle`, and returns the log.
async fn log_shows(log: &Path, needle: &str) -> String {
    eventually(needle, Duration::from_secs(15), || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        async move { text.contains(needle).then_some(text) }
    })
    .await
}

/// A controller with a certificate of `ca` (and `extra` flags) and one
/// stage `id` with a certificate of `ca` naming it, running settings for a
/// trainer.
struct Cluster {
    _controller: support::KillOnDrop,
    _stage: support::KillOnDrop,
    _trainer: std::os::unix::net::UnixStream,
    grpc: String,
    url: String,
    server: Party,
    stage: Party,
    admin: AdminServiceClient<Channel>,
    /// The settings version the stage acknowledged first.
    first: u64,
}

async fn cluster(dir: &Path, ca: &Authority, id: &str, extra: &[&str]) -> Cluster {
    let server = ca.issue("controller", &["localhost", "127.0.0.1"]);
    let stage = ca.issue(id, &[id]);
    let db = format!("sqlite://{}", dir.join("c.db").display());
    let mut c = controller_command(&db);
    c.args(server.args()).args(extra);
    let (controller, ready) = support::start(c, &dir.join("controller.log"));
    let grpc = ready["grpc"].as_str().unwrap().to_owned();
    let url = format!("https://{grpc}");
    let (mut command, socket) = stage_command(dir, id, &url);
    command.args(stage.args());
    let (stage_process, _) = support::start(command, &dir.join(format!("{id}.log")));
    let trainer = trainer(&socket, "resnet");
    let mut admin = admin(&grpc, &stage).await;
    apply(&mut admin, "policy.yaml", &policy("100MB/s"))
        .await
        .unwrap();
    let first = acked_above(&admin, id, 0).await;
    Cluster {
        _controller: controller,
        _stage: stage_process,
        _trainer: trainer,
        grpc,
        url,
        server,
        stage,
        admin,
        first,
    }
}

/// The ids of the stages the controller has.
async fn stage_ids(admin: &mut AdminServiceClient<Channel>) -> Vec<String> {
    admin
        .list_stages(ListStagesRequest {})
        .await
        .unwrap()
        .into_inner()
        .stages
        .into_iter()
        .map(|s| s.id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_with_the_cas_certificate_run_settings_and_others_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "cluster");
    let rogue = Authority::new(dir.path(), "rogue").issue("stage", &["stage-rogue"]);
    // Kept whole: its processes run while it lives.
    let good = cluster(dir.path(), &ca, "stage-good", &[]).await;
    let mut admin = good.admin.clone();
    let (grpc, url, server, client, first) = (
        good.grpc.clone(),
        good.url.clone(),
        &good.server,
        &good.stage,
        good.first,
    );
    let grpc = grpc.as_str();

    // A certificate from another CA: the handshake fails, the stage keeps
    // retrying and never shows up.
    // It trusts the real controller: only its own certificate is wrong.
    let (rogue_cert, rogue_key) = (rogue.cert.clone(), rogue.key.clone());
    let rogue = Party {
        ca: server.ca.clone(),
        ..rogue
    };
    let (mut stranger, _) = stage_command(dir.path(), "stage-rogue", &url);
    stranger.args(rogue.args());
    let rogue_log = dir.path().join("rogue.log");
    let _rogue = support::start(stranger, &rogue_log);
    let text = log_shows(&rogue_log, "controller session ended").await;
    assert!(text.contains("the TLS handshake failed"), "{text}");

    // Plain text against the TLS port: refused, and the log says why.
    let plain_url = format!("http://{grpc}");
    let (plain, _) = stage_command(dir.path(), "stage-plain", &plain_url);
    let plain_log = dir.path().join("plain.log");
    let _plain = support::start(plain, &plain_log);
    let text = log_shows(&plain_log, "controller session ended").await;
    assert!(text.contains("it requires TLS"), "{text}");

    // The controller kept serving the good stage.
    apply(&mut admin, "policy.yaml", &policy("200MB/s"))
        .await
        .unwrap();
    acked_above(&admin, "stage-good", first).await;
    assert_eq!(stage_ids(&mut admin).await, ["stage-good"]);

    // sluicectl presents the same kind of certificate, named by its
    // --tls-* flags or the daemons' variables; without them an https://
    // server is a usage error.
    let sluicectl = || {
        let mut c = Command::new(sluice_tests::binary("sluicectl"));
        c.args(["--server", &url, "get", "stages"])
            .env_remove("SLUICE_SERVER");
        c
    };
    let mut with_tls = sluicectl();
    for (name, path) in [
        ("SLUICE_TLS_CERT", &client.cert),
        ("SLUICE_TLS_KEY", &client.key),
        ("SLUICE_TLS_CA", &client.ca),
    ] {
        with_tls.env(name, path);
    }
    let mut with_flags = sluicectl();
    with_flags.arg("--tls-cert").arg(&client.cert);
    with_flags.arg("--tls-key").arg(&client.key);
    with_flags.arg("--tls-ca").arg(&client.ca);
    for name in ["SLUICE_TLS_CERT", "SLUICE_TLS_KEY", "SLUICE_TLS_CA"] {
        with_flags.env_remove(name);
    }
    for mut command in [with_tls, with_flags] {
        let out = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        assert!(stdout.contains("stage-good"), "{stdout}");
    }
    // A certificate the controller does not trust, and plain text against
    // its TLS port: one line that says what to check.
    let mut untrusted = sluicectl();
    untrusted.arg("--tls-cert").arg(&rogue_cert);
    untrusted.arg("--tls-key").arg(&rogue_key);
    untrusted.arg("--tls-ca").arg(&client.ca);
    let (code, stderr) = refused(untrusted);
    assert_eq!(code, 1, "{stderr}");
    // Whether the controller's alert or only a closed stream reaches
    // sluicectl depends on timing; either way it names the certificate.
    assert!(
        stderr.contains("sluicectl's client certificate"),
        "{stderr}"
    );
    let mut plain = Command::new(sluice_tests::binary("sluicectl"));
    plain
        .args(["--server", &format!("http://{grpc}"), "get", "stages"])
        .env_remove("SLUICE_SERVER");
    let (code, stderr) = refused(plain);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("use an https:// --server"), "{stderr}");

    let mut without = sluicectl();
    for name in ["SLUICE_TLS_CERT", "SLUICE_TLS_KEY", "SLUICE_TLS_CA"] {
        without.env_remove(name);
    }
    let (code, stderr) = refused(without);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("(missing --tls-cert)"), "{stderr}");
}

/// Runs `command` to its end and returns (exit code, standard error).
fn refused(mut command: Command) -> (i32, String) {
    let out = command.output().unwrap();
    let code = out.status.code().unwrap_or(-1);
    (code, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn half_given_flags_and_bad_files_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let party = Authority::new(dir.path(), "cluster").issue("controller", &["localhost"]);
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let db = format!("sqlite://{}", dir.path().join("c.db").display());

    let mut c = controller_command(&db);
    c.arg(format!("--tls-cert={}", party.cert.display()));
    let (code, stderr) = refused(c);
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains("--tls-key") && stderr.contains("go together"),
        "{stderr}"
    );

    let bad_ca = Party {
        cert: party.cert.clone(),
        key: party.key.clone(),
        ca: garbage.clone(),
    };
    let mut c = controller_command(&db);
    c.args(bad_ca.args());
    let (code, stderr) = refused(c);
    assert_eq!(code, 64, "{stderr}");
    let named = format!("{} is not a valid PEM file", garbage.display());
    assert!(
        stderr.contains("--tls-ca") && stderr.contains(&named),
        "{stderr}"
    );

    let certificate_as_key = Party {
        key: party.cert.clone(),
        ..party
    };
    let (mut s, _) = stage_command(dir.path(), "stage", "https://127.0.0.1:1");
    s.args(certificate_as_key.args());
    let (code, stderr) = refused(s);
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains("--tls-key") && stderr.contains("private key"),
        "{stderr}"
    );

    let (s, _) = stage_command(dir.path(), "stage", "https://127.0.0.1:1");
    let (code, stderr) = refused(s);
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains("--tls-cert, --tls-key and --tls-ca"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_bound_ids_a_stage_takes_only_the_id_its_certificate_names() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "cluster");
    let mut bound = cluster(dir.path(), &ca, "stage-a", &["--bind-stage-ids"]).await;

    // The same certificate under another id: refused, saying what to fix.
    let (mut impostor, _) = stage_command(dir.path(), "stage-b", &bound.url);
    impostor.args(bound.stage.args());
    let log = dir.path().join("b.log");
    let _impostor = support::start(impostor, &log);
    let text = log_shows(&log, "is not named by the stage's client certificate").await;
    assert!(text.contains("DNS:stage-b"), "{text}");
    assert_eq!(stage_ids(&mut bound.admin).await, ["stage-a"]);

    // Binding ids needs certificates.
    let mut plain = controller_command(&format!(
        "sqlite://{}",
        dir.path().join("plain.db").display()
    ));
    plain.arg("--bind-stage-ids");
    let (code, stderr) = refused(plain);
    assert_eq!(code, 64, "{stderr}");
    assert!(stderr.contains("needs mutual TLS"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_speak_do_not_shut_out_the_controllers_clients() {
    // 300 connections that send nothing, to a controller allowed 256
    // descriptors, took them all: `sluicectl`, new stage sessions and
    // `/healthz` were refused until they left.
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "cluster");
    let server = ca.issue("controller", &["localhost", "127.0.0.1"]);
    let operator = ca.issue("operator", &["operator"]);
    let base = controller_command(&format!("sqlite://{}", dir.path().join("c.db").display()));
    let mut c = Command::new("prlimit");
    c.arg("--nofile=256:256")
        .arg("--")
        .arg(base.get_program())
        .args(base.get_args())
        .args(server.args());
    let (_controller, ready) = support::start(c, &dir.path().join("controller.log"));
    let grpc = ready["grpc"].as_str().unwrap().to_owned();
    let http = ready["http"].as_str().unwrap().to_owned();
    let silent: Vec<_> = (0..300)
        .map(|_| std::net::TcpStream::connect(&grpc).unwrap())
        .collect();
    // The later half, which the listener holds once the earlier ones gave
    // their places to them, send a byte of a TLS handshake now and then,
    // never finishing it: counted as having spoken, they were never closed
    // to make room, and held every place.
    let stop = Arc::new(AtomicBool::new(false));
    let trickle = {
        let stop = Arc::clone(&stop);
        let mut tricklers: Vec<_> = silent
            .iter()
            .skip(150)
            .map(|s| s.try_clone().unwrap())
            .collect();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for s in &mut tricklers {
                    let _ = std::io::Write::write_all(s, &[0x16]);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        let mut admin = admin(&grpc, &operator).await;
        assert_eq!(stage_ids(&mut admin).await, Vec::<String>::new());
        admin
    });
    let admin = answered
        .await
        .expect("the controller answered sluicectl's request");
    assert!(support::http(&http, "GET", "/healthz", "").starts_with("HTTP/1.1 200"));
    let (command, _) = stage_command(dir.path(), "stage-a", &format!("https://{grpc}"));
    let mut command = command;
    command.args(ca.issue("stage-a", &["stage-a"]).args());
    let _stage = support::start(command, &dir.path().join("stage.log"));
    eventually("the stage's session", Duration::from_secs(20), || {
        let mut admin = admin.clone();
        async move { (stage_ids(&mut admin).await == ["stage-a"]).then_some(()) }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    trickle.join().unwrap();
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_that_never_answers_the_handshake_is_given_up() {
    // A listener that accepts and says nothing: a stopped controller, or a
    // network partition. The stage and sluicectl waited in their TLS
    // handshakes for ever (the connect timeout is the TCP connect's).
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "cluster");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}", silent.local_addr().unwrap());
    let held = std::thread::spawn(move || {
        let accepted: Vec<_> = silent.incoming().take(4).collect();
        std::thread::sleep(Duration::from_secs(60));
        drop(accepted);
    });
    let (mut stage, _) = stage_command(dir.path(), "stage-a", &url);
    stage.args(ca.issue("stage-a", &["stage-a"]).args());
    let log = dir.path().join("stage.log");
    let _stage = support::start(stage, &log);
    let operator = ca.issue("operator", &["operator"]);
    let mut ctl = Command::new(sluice_tests::binary("sluicectl"));
    ctl.args(["--server", &url, "get", "stages"])
        .args(operator.args())
        .env_remove("SLUICE_SERVER");
    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || ctl.output().unwrap());
    let text = log_shows(&log, "TLS handshake included) within 10s").await;
    assert!(text.contains("retry_in"), "{text}");
    let out = out.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no connection within 30 s"), "{stderr}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(45), "{took:?}");
    drop(held);
}
