//! What the end-to-end tests share: starting the real binaries, a trainer
//! that makes a stage report a job, polling with a deadline, plain HTTP.

#![allow(dead_code)] // each test file uses its own part

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sluice_proto::AdminServiceClient;
use sluice_proto::v1::{ApplyPoliciesRequest, ListStagesRequest, PolicySource, StageState};
use sluice_stage::Request as Frame;
use tonic::transport::Channel;

pub use sluice_tests::eventually;

/// A job policy that gives job `resnet` (labels `team: vision`) a limit.
pub fn policy(bytes_per_second: &str) -> String {
    format!(
        "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {{name: shared}}
spec: {{capacity: {{bandwidth: 1GB/s}}}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: vision}}
spec:
  selector: {{matchLabels: {{team: vision}}}}
  pool: shared
  limit: {{bandwidth: {bytes_per_second}}}
"
    )
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a binary, its standard error written to `log` (also shown when
/// `SLUICE_TEST_LOGS` is set), and returns it with its JSON ready line.
pub fn start(mut command: Command, log: &Path) -> (KillOnDrop, serde_json::Value) {
    let stderr = std::fs::File::create(log).expect("creating the log file");
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("the binary starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready = serde_json::from_str(&line).unwrap_or_else(|e| {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        panic!("ready line {line:?}: {e}; log:\n{log}")
    });
    (KillOnDrop(child), ready)
}

/// Returns the `sluice-controller` command on ephemeral ports with a fast
/// tick, on the store at `database_url`.
pub fn controller_command(database_url: &str) -> Command {
    controller_command_at(database_url, "127.0.0.1:0")
}

/// Returns [`controller_command`] with gRPC on `grpc_addr` (a restarted
/// controller takes its predecessor's address).
pub fn controller_command_at(database_url: &str, grpc_addr: &str) -> Command {
    let mut c = Command::new(sluice_tests::binary("sluice-controller"));
    c.args(["--grpc-addr", grpc_addr, "--http-addr", "127.0.0.1:0"])
        .arg(format!("--database-url={database_url}"))
        .args(["--tick", "200ms", "--stage-timeout", "2s"]);
    c
}

/// Returns the `sluice-stage` command for stage `id` (socket and dataset
/// under `dir`) with a session to `controller` (a URL).
pub fn stage_command(dir: &Path, id: &str, controller: &str) -> (Command, PathBuf) {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("a.bin"), b"abc").unwrap();
    let socket = dir.join(format!("{id}.sock"));
    let mut c = Command::new(sluice_tests::binary("sluice-stage"));
    c.args(["--socket", socket.to_str().unwrap()])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--stage-id", id, "--node", id, "--memory-budget", "256MiB"])
        .arg(format!("--dataset=train={}", data.display()))
        .arg(format!("--controller={controller}"));
    (c, socket)
}

/// Says HELLO as a trainer of `job` (labels `team: vision`) and returns the
/// open connection, which keeps the job on the stage.
pub fn trainer(socket: &Path, job: &str) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    let hello = Frame::Hello {
        version: 1,
        job: job.into(),
        labels: BTreeMap::from([("team".to_owned(), "vision".to_owned())]),
        rank: 0,
        world_size: 1,
        features: 0,
    };
    s.write_all(&hello.encode()).unwrap();
    assert_eq!(frame(&mut s).0, 0x81, "WELCOME");
    s
}

/// Reads one frame from the stage: its type byte and payload.
pub fn frame(s: &mut UnixStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).unwrap();
    let mut rest = vec![0u8; u32::from_be_bytes(head[..4].try_into().unwrap()) as usize - 1];
    s.read_exact(&mut rest).unwrap();
    (head[4], rest)
}

/// Reads `a.bin` (the file [`stage_command`] writes) of data set `train`
/// on a trainer's connection, as a trainer does: open, then read.
pub fn read_sample(s: &mut UnixStream) -> Vec<u8> {
    s.write_all(
        &Frame::Open {
            dataset: "train".into(),
        }
        .encode(),
    )
    .unwrap();
    assert_eq!(frame(s).0, 0x82, "OPENED");
    let read = Frame::Read {
        name: "a.bin".into(),
        offset: 0,
        length: 3,
    };
    s.write_all(&read.encode()).unwrap();
    let (kind, payload) = frame(s);
    assert_eq!(kind, 0x86, "DATA: {}", String::from_utf8_lossy(&payload));
    payload[4..].to_vec()
}

/// Sends one HTTP/1.1 request and returns the whole response.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    http_with(addr, method, path, "", body)
}

/// Waits until the controller at `http_addr` answers `/readyz` with 200
/// (a standby that took the lease, a leader back from an outage).
pub async fn until_ready(http_addr: &str, within: Duration) {
    eventually("the controller to turn ready", within, || {
        let ready = http(http_addr, "GET", "/readyz", "").starts_with("HTTP/1.1 200");
        async move { ready.then_some(()) }
    })
    .await;
}

/// [`http`] with extra header lines (`"Name: value\r\n"` each).
pub fn http_with(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> String {
    try_http(addr, method, path, headers, body).unwrap()
}

/// [`http_with`] that returns the error of a server that went away
/// mid-request (a replica killed by a chaos test) instead of failing.
pub fn try_http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// An admin client of the controller at `grpc` (plain text).
pub async fn admin(grpc: &str) -> AdminServiceClient<Channel> {
    AdminServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap()
}

/// Applies `yaml` as one policy file called `name` through the admin API.
pub async fn apply(
    client: &mut AdminServiceClient<Channel>,
    name: &str,
    yaml: &str,
) -> Result<(), tonic::Status> {
    let request = ApplyPoliciesRequest {
        sources: vec![PolicySource {
            name: name.into(),
            yaml: yaml.into(),
        }],
        dry_run: false,
    };
    client.apply_policies(request).await.map(|_| ())
}

/// Waits until stage `id` is connected and runs the version the controller
/// wants for it, above `above`, and returns that version.
pub async fn acked_above(client: &AdminServiceClient<Channel>, id: &str, above: u64) -> u64 {
    eventually(
        "the stage to ack a new settings version",
        Duration::from_secs(30),
        || {
            let mut client = client.clone();
            async move {
                let stages = client.list_stages(ListStagesRequest {}).await.ok()?;
                stages.into_inner().stages.into_iter().find_map(|s| {
                    (s.id == id
                        && s.state == StageState::Connected as i32
                        && s.desired_version > above
                        && s.acked_version == s.desired_version)
                        .then_some(s.acked_version)
                })
            }
        },
    )
    .await
}

/// Stands in for a Kubernetes Service in front of the replicas: each new
/// connection goes to the first backend whose `/readyz` answers 200 (gRPC,
/// HTTP address pairs); with none ready it is closed at once.
pub fn service(backends: Vec<(String, String)>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let ready = backends.iter().find(|(_, http_addr)| {
                try_http(http_addr, "GET", "/readyz", "", "")
                    .is_ok_and(|answer| answer.starts_with("HTTP/1.1 200"))
            });
            let Some(server) = ready.and_then(|(grpc, _)| TcpStream::connect(grpc).ok()) else {
                continue;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Both);
                    let _ = from.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
    addr
}

/// A controller replica and where it listens.
pub struct Replica {
    pub process: KillOnDrop,
    pub ready_line: serde_json::Value,
    pub grpc: String,
    pub http: String,
}

/// Starts a controller replica on `database_url` ([`controller_command`]).
pub fn replica(database_url: &str, log: &std::path::Path) -> Replica {
    let (process, ready_line) = start(controller_command(database_url), log);
    Replica {
        process,
        grpc: ready_line["grpc"].as_str().unwrap().to_owned(),
        http: ready_line["http"].as_str().unwrap().to_owned(),
        ready_line,
    }
}
